"""The decode kernels of the GPU path against plain torch: the fused q/k-norm + RoPE + KV-store
epilogue (engine/kernels/qkv.py) and the skinny GEMV (engine/kernels/gemv.py).

On CUDA they run compiled, in bf16; without CUDA in Triton's interpreter, in float32, which
checks the indexing, masking and the split-K sums (the speed is the GPU check's business)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.triton_env import (  # first: it sets TRITON_INTERPRET without CUDA
    CUDA,
    DEVICE,
    DTYPE,
)

pytest.importorskip("triton")

from engine.models.rope import RotaryEmbedding  # noqa: E402

# bf16: the fused kernel rounds once where the reference rounds after the norm and after RoPE,
# so they differ by about one bf16 unit (2^-8 relative) of the largest values; float32: noise
TOL = 2e-2 if CUDA else 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def heads(hq: int, hk: int) -> tuple[int, int]:
    """(query heads, KV heads) of a case: as given on CUDA; in the interpreter, which runs each
    head's program in Python, the same query heads per KV head over 2 KV heads (the same paths,
    a fraction of the programs)."""
    return (hq, hk) if CUDA or hk <= 3 else (hq // hk * 2, 2)


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
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (*heads(16, 8), 128), (9, 3, 64)])
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
    # neither a multiple of the blocks: the masks are exercised (with split_k=4 the last split
    # starts past K). N: 6 programs, the last one part-filled (the interpreter runs each program
    # in Python: 200 rows, 25 programs, took 4x as long for the same paths).
    n, k = 44, 300
    x = torch.randn(rows, k, device=DEVICE, generator=g).to(DTYPE)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(DTYPE)
    b = torch.randn(n, device=DEVICE, generator=g).to(DTYPE) if bias else None
    got = gemv(x, w, b, Config(block_n=8, block_k=64, split_k=split_k))
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == DTYPE and got.shape == (rows, n)
    assert rel_err(got, want) < (1e-2 if CUDA else 1e-5)


@pytest.mark.parametrize("rows", [9, 33, 64])
@pytest.mark.parametrize("split_k", [1, 2])
def test_tensor_core_path_matches_linear(rows: int, split_k: int) -> None:
    from engine.kernels.gemv import Config, gemv

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    n, k = 100, 200
    x = torch.randn(rows, k, device=DEVICE, generator=g).to(DTYPE)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(DTYPE)
    b = torch.randn(n, device=DEVICE, generator=g).to(DTYPE)
    got = gemv(x, w, b, Config(block_n=32, block_k=64, split_k=split_k, dot=True))
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert rel_err(got, want) < (1e-2 if CUDA else 1e-5)


def test_each_path_refuses_rows_it_was_not_made_for() -> None:
    from engine.kernels.gemv import GEMV_ROWS, MAX_ROWS, Config, gemv

    w = torch.zeros(8, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(AssertionError):
        gemv(torch.zeros(GEMV_ROWS + 1, 16, dtype=DTYPE, device=DEVICE), w, None)
    with pytest.raises(AssertionError):
        gemv(
            torch.zeros(MAX_ROWS + 1, 16, dtype=DTYPE, device=DEVICE),
            w,
            None,
            Config(16, 16, dot=True),
        )


def test_shapes_use_cublas_unless_timing_chose_a_kernel(tmp_path, monkeypatch) -> None:
    import json

    from engine.kernels import gemv as G

    tuned = tmp_path / "gemv_tuned.json"
    monkeypatch.setattr(G, "TABLE", G.TunedTable(tuned, ("n", "k"), G.Config))
    row = {"n": 1024, "k": 2048, "rows": 4, "config": {"block_n": 4, "block_k": 512}}
    tuned.write_text(
        json.dumps({"Some GPU": [row, {"n": 1024, "k": 2048, "rows": 8, "config": None}]})
    )
    assert G.choose(1024, 2048, 3, "Another GPU") is None  # no table for that device
    assert G.choose(1024, 2048, 3, "Some GPU") == G.Config(4, 512)  # 3 rows: the 4-row class
    assert G.choose(1024, 2048, 7, "Some GPU") is None  # timed: cuBLAS won
    assert G.choose(1024, 2048, 65, "Some GPU") is None  # past MAX_ROWS
    G.set_choice(4096, 1024, 1, G.Config(8, 1024))
    assert G.table_rows("Some GPU")["Some GPU"][-1] == {
        "n": 4096, "k": 1024, "rows": 1,
        "config": {"block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4, "dot": False},
    }  # fmt: skip


def test_unknown_kernel_names_are_refused_with_their_source(monkeypatch) -> None:
    import importlib.util

    from engine.models import kernels
    from engine.models.kernels import set_unfused

    with pytest.raises(ValueError, match="unknown kernels \\['qvk'\\]"):
        set_unfused(["qvk"])
    # the module's import reads the variable: run its code again as a fresh module (a process
    # of its own took 2 s of imports to say the same), leaving the imported one untouched
    monkeypatch.setenv("STEPSCOPE_UNFUSED", "gemv,qvk")
    spec = importlib.util.spec_from_file_location("kernels_again", kernels.__file__)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ValueError, match=r"^STEPSCOPE_UNFUSED: unknown kernels \['qvk'\]"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _paged(lens: list[int], page: int, hk: int, d: int, g: torch.Generator):
    """A shuffled paged cache holding len(lens) requests, and its index arrays."""
    npages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(npages) + 3, generator=g, device=DEVICE)
    k = torch.randn(len(order) * page, hk, d, device=DEVICE, generator=g).to(DTYPE)
    v = torch.randn(len(order) * page, hk, d, device=DEVICE, generator=g).to(DTYPE)
    indptr = torch.tensor([0] + npages, device=DEVICE).cumsum(0).to(torch.int32)
    return k, v, indptr, order[: int(indptr[-1])].to(torch.int32)


@pytest.mark.parametrize(
    "hq,hk,d,page,dot",
    [(*heads(16, 8), 128, 16, False), (*heads(16, 8), 128, 16, True), (9, 3, 64, 1, True),
     (*heads(4, 4), 64, 16, False)],
)  # fmt: skip
@pytest.mark.parametrize("splits", [1, 8])
def test_decode_attention_matches_softmax_over_the_pages(
    hq: int, hk: int, d: int, page: int, dot: bool, splits: int
) -> None:
    from engine.kernels.decode import Config, Workspace, decode_attention

    g = torch.Generator(device=DEVICE).manual_seed(hq * page + splits)
    # one key; one page exactly; one past it; long enough that every split has keys, and
    # short ones that leave most splits empty
    lens = [1, 16, 17, 150]
    k, v, indptr, indices = _paged(lens, page, hk, d, g)
    q = torch.randn(len(lens), hq, d, device=DEVICE, generator=g).to(DTYPE)
    ws = Workspace.for_batch(len(lens), hk, hq // hk, d, splits, DEVICE)
    kv_len = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for _ in range(2 if splits > 1 else 1):  # a second launch finds the tickets reset
        out = decode_attention(
            q, k, v, kv_len, indptr, indices, page, d**-0.5, Config(splits, 16, dot=dot), ws
        )
    assert not ws.ticket.any()
    for i, n in enumerate(lens):
        pages = indices[indptr[i] : indptr[i + 1]].long()
        slots = (pages[:, None] * page + torch.arange(page, device=DEVICE)).flatten()[:n]
        kk = k[slots].float().repeat_interleave(hq // hk, 1)
        vv = v[slots].float().repeat_interleave(hq // hk, 1)
        p = (torch.einsum("hd,nhd->hn", q[i].float(), kk) * d**-0.5).softmax(-1)
        want = torch.einsum("hn,nhd->hd", p, vv)
        assert rel_err(out[i], want) < (1e-2 if CUDA else 1e-5), (i, n)


def test_decode_splits_fill_the_device_and_stop_once_the_batch_does() -> None:
    from engine.kernels.decode import config_for

    assert config_for(1, 8, 2, 128, sms=132).splits == 32  # 8 programs: split the keys
    assert config_for(16, 8, 2, 128, sms=132).splits == 4
    assert config_for(64, 8, 2, 128, sms=132).splits == 1  # 512 programs fill 132 SMs
    assert config_for(1, 8, 2, 128, sms=132).block_n * 2 * 128 <= 8192


def test_decode_graphs_use_the_tuned_table_and_flashinfer_where_untuned(
    tmp_path, monkeypatch
) -> None:
    import json

    from engine.kernels import decode as D

    tuned = tmp_path / "decode_tuned.json"
    monkeypatch.setattr(D, "TABLE", D.TunedTable(tuned, ("group", "head_dim"), D.Config))
    cfg = {"splits": 4, "block_n": 64, "num_warps": 4, "num_stages": 3, "dot": True}
    rows = [
        {"group": 2, "head_dim": 128, "rows": 16, "config": cfg},
        {"group": 2, "head_dim": 128, "rows": 64, "config": None},
    ]
    tuned.write_text(json.dumps({"Some GPU": rows}))
    shape = (8, 2, 128, 132)  # KV heads, group, head dim, SMs
    # untuned: the kernel at batch 1 only
    assert D.choose(1, *shape, "Another GPU") == D.config_for(1, *shape)
    assert D.choose(2, *shape, "Another GPU") is None
    assert D.choose(12, *shape, "Some GPU") == D.Config(**cfg)  # 12 rows: the 16-row class
    assert D.choose(40, *shape, "Some GPU") is None  # timed: FlashInfer won
    D.set_choice(2, 128, 1, D.Config(32, 16))
    assert D.table_rows("Some GPU")["Some GPU"][0] == {
        "group": 2, "head_dim": 128, "rows": 1,
        "config": {"splits": 32, "block_n": 16, "num_warps": 4, "num_stages": 2, "dot": False},
    }  # fmt: skip


def _hf_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm, with its roundings: normalize in float32, round, scale, round."""
    f = h.float()
    n = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return (w.float() * n.float()).to(h.dtype)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("act", [False, True])
def test_norm_gemv_folds_the_residual_add_norm_and_activation(
    rows: int, first: bool, act: bool
) -> None:
    from engine.kernels.gemv import Config, norm_gemv

    g = torch.Generator(device=DEVICE).manual_seed(rows * 2 + act)
    # n and k off the blocks: the masks are exercised (n = 22: 3 programs of 8 rows, or with
    # act 6 programs of 4 gate and 4 up rows, the last part-filled in both)
    n, k, eps = 22, 300, 1e-6
    x = None if first else (torch.randn(rows, k, device=DEVICE, generator=g) * 2).to(DTYPE)
    res = torch.randn(rows, k, device=DEVICE, generator=g).to(DTYPE)
    nw = (torch.rand(k, device=DEVICE, generator=g) + 0.5).to(DTYPE)
    w = (torch.randn(2 * n if act else n, k, device=DEVICE, generator=g) / k**0.5).to(DTYPE)
    b = None if act else torch.randn(n, device=DEVICE, generator=g).to(DTYPE)
    before = res.clone()
    y, r_out = norm_gemv(x, res, nw, eps, w, b, Config(block_n=8, block_k=128), act=act)
    want_r = before if x is None else (x.float() + before.float()).to(DTYPE)
    xn = _hf_norm(want_r, nw, eps)
    proj = torch.nn.functional.linear(xn.float(), w.float(), None if b is None else b.float())
    if act:
        gate, up = proj.to(DTYPE).float().chunk(2, dim=-1)
        proj = torch.nn.functional.silu(gate) * up
    assert torch.equal(res, before)  # the input residual is left as it was
    assert torch.equal(r_out, want_r)
    assert y.shape == (rows, n) and rel_err(y, proj) < (1e-2 if CUDA else 1e-5)


@pytest.mark.skipif(CUDA, reason="the wiring in float32; on CUDA the GPU tests hold it to HF")
def test_the_model_gives_the_same_tokens_with_the_norms_folded(tiny_qwen3_dir, monkeypatch) -> None:
    """The decoder layer's folded path (residual add and norm inside the qkv and gate-up GEMVs,
    the activation inside gate-up, the first layer's norm alone) against its unfolded one. On
    CPU the kernels run in the interpreter, in float32, so only the wiring can differ."""
    from engine import LLM, SamplingParams
    from engine.kernels import gemv as G
    from engine.models import parallel

    prompt = list(range(40, 61))
    # the second request ends first: decode steps of two rows, then of one
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 2)]

    def tokens() -> list[dict]:
        llm = LLM(str(tiny_qwen3_dir), page_size=4, max_running_req=2, progress=False)
        return llm.generate([prompt, prompt[:9]], params)

    plain = tokens()
    folds: list[tuple[int, int]] = []
    real = G.norm_gemv

    def counted(x, residual, *args, **kw):
        folds.append((residual.shape[0], kw.get("act", False)))
        return real(x, residual, *args, **kw)

    monkeypatch.setattr(G, "norm_gemv", counted)
    monkeypatch.setattr(G, "TABLE", G.TunedTable(G.TUNED, ("n", "k"), G.Config))
    monkeypatch.setattr(parallel, "folded_gemv", lambda x: G)
    monkeypatch.setattr(parallel, "device_name", lambda device: "interpreter")
    for n in (256,):  # qkv (4 x 32 + 2 x 2 x 32) and gate-up (2 x 128) of the tiny Qwen3
        for rows in (1, 2):
            # two programs a launch: the wiring is what differs from the kernel's own test
            # (test_norm_gemv_folds_...), and the interpreter runs each program in Python
            G.set_choice(n, 64, rows, G.Config(block_n=128, block_k=64))
    folded = tokens()
    assert [o["token_ids"] for o in folded] == [o["token_ids"] for o in plain]
    # decode steps of one and two rows folded both norms of both layers; prefill did not
    assert {(1, False), (1, True), (2, False), (2, True)} <= set(folds)
    assert all(rows <= 2 for rows, _ in folds)


def test_norm_gemv_refuses_a_residual_wider_than_the_weights() -> None:
    """It rounds the new residual stream to the weights' dtype, so a float32 stream (the
    `residual_dtype="float32"` option) must take the unfolded path instead."""
    from engine.kernels.gemv import Config, norm_gemv

    w = torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE)
    res = torch.zeros(1, 16, dtype=torch.float32, device=DEVICE)
    nw = torch.ones(16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError):
        norm_gemv(res.to(torch.bfloat16), res, nw, 1e-6, w, None, Config(8, 16))


def test_the_cpu_matmuls_reordered_weights_follow_in_place_writes() -> None:
    """A float32 CPU Linear keeps its weight reordered for oneDNN; a later in-place write
    (load_state_dict, copy_) must reach the matmul, not leave it on the old values."""
    from engine.models.parallel import Linear

    layer = Linear(64, 32)
    layer.prepack()
    x = torch.randn(5, 64)
    for write in ("copy_", "load_state_dict"):
        new = {k: torch.randn_like(v) for k, v in layer.state_dict().items()}
        if write == "copy_":
            with torch.no_grad():
                layer.weight.copy_(new["weight"])
        else:
            layer.load_state_dict(new)
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
