"""The decode kernels of the GPU path against plain torch: the fused q/k-norm + RoPE + KV-store
epilogue (engine/kernels/qkv.py) and the skinny GEMV (engine/kernels/gemv.py).

On CUDA they run compiled, in bf16; without CUDA in Triton's interpreter, in float32, which
checks the indexing, masking and the split-K sums (the speed is the GPU check's business)."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before any kernel module is imported: triton.jit reads it at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.models.rope import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
# bf16: the fused kernel rounds once where the reference rounds after the norm and after RoPE,
# so they differ by about one bf16 unit (2^-8 relative) of the largest values; float32: noise
TOL = 2e-2 if CUDA else 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _reference(qkv, positions, rope, qw, kw, eps, hq, hk, d):
    n = qkv.shape[0]
    q, k, v = qkv.float().split((hq * d, hk * d, hk * d), dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hk, d), v.view(n, hk, d)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    if qw is not None:
        q, k = norm(q, qw), norm(k, kw)
    cos = rope.cos[positions].float().unsqueeze(1)
    sin = rope.sin[positions].float().unsqueeze(1)

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin, v


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (16, 8, 128), (9, 3, 64)])
def test_qkv_epilogue_matches_norm_rope_and_store(qk_norm: bool, hq: int, hk: int, d: int) -> None:
    from engine.kernels.qkv import qkv_epilogue

    g = torch.Generator(device=DEVICE).manual_seed(hq * d)
    n, slots = 7, 40
    qkv = (torch.randn(n, (hq + 2 * hk) * d, device=DEVICE, generator=g) * 3).to(DTYPE)
    positions = torch.tensor([0, 1, 5, 17, 200, 999, 3], device=DEVICE)
    rope = RotaryEmbedding(d, 1024, 1e6, None)
    rope.build_table(torch.device("cpu"))
    cos_sin = torch.cat([rope.cos[:, : d // 2], rope.sin[:, : d // 2]], dim=-1).to(DEVICE)
    rope.cos, rope.sin = rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    qw = torch.rand(d, device=DEVICE, generator=g).to(DTYPE) + 0.5 if qk_norm else None
    kw = torch.rand(d, device=DEVICE, generator=g).to(DTYPE) + 0.5 if qk_norm else None
    k_cache = torch.zeros(slots, hk, d, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros(slots, hk, d, dtype=DTYPE, device=DEVICE)
    loc = torch.tensor([3, 9, 0, 39, 20, 21, 5], device=DEVICE)
    q = qkv_epilogue(qkv, positions, cos_sin, qw, kw, 1e-6, k_cache, v_cache, loc, hq, hk, d)
    want_q, want_k, want_v = _reference(qkv, positions, rope, qw, kw, 1e-6, hq, hk, d)
    assert q.shape == (n, hq, d) and rel_err(q, want_q) < TOL
    assert rel_err(k_cache[loc], want_k) < TOL
    assert torch.equal(v_cache[loc], want_v.to(DTYPE))  # V is copied, bit for bit
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(rows: int, split_k: int, bias: bool) -> None:
    from engine.kernels.gemv import Config, gemv

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    n, k = 200, 300  # neither a multiple of the blocks: the masks are exercised
    x = torch.randn(rows, k, device=DEVICE, generator=g).to(DTYPE)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(DTYPE)
    b = torch.randn(n, device=DEVICE, generator=g).to(DTYPE) if bias else None
    got = gemv(x, w, b, Config(block_n=8, block_k=64, split_k=split_k))
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == DTYPE and got.shape == (rows, n)
    assert rel_err(got, want) < (1e-2 if CUDA else 1e-5)


def test_gemv_refuses_a_batch_it_was_not_made_for() -> None:
    from engine.kernels.gemv import MAX_ROWS, gemv

    x = torch.zeros(MAX_ROWS + 1, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(AssertionError):
        gemv(x, torch.zeros(8, 16, dtype=DTYPE, device=DEVICE), None)
