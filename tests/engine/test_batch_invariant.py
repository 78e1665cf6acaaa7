"""Batch invariance: the Triton matmul, paged attention and RMSNorm, and `LLM(batch_invariant=True)`.

The claim is bit for bit: a row's result does not depend on the rows beside it, nor on how a
prompt was cut into chunks. On CUDA the kernels run compiled, in bf16, and `same` is exact
equality. Without CUDA they run in Triton's interpreter, in float32: that checks the indexing,
masking and tiling, but numpy's matmul rounds a row differently by its place in a tile, so there
`same` allows float32 noise; the bits are a property of the GPU's fixed-shape MMA instructions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.triton_env import (  # first: it sets TRITON_INTERPRET without CUDA
    CUDA,
    DEVICE,
    DTYPE,
)

pytest.importorskip("triton")

from checks.greedy import compare_greedy, rel_err, trace_run  # noqa: E402
from engine.attention.base import BatchLayout  # noqa: E402
from engine.kvcache.pool import KVPool  # noqa: E402
from engine.kvcache.table import PageTable  # noqa: E402
from instrumentation.sampling import SamplingParams  # noqa: E402
from tests.helpers import hf_greedy  # noqa: E402

# against the torch reference, which sums in another order: bf16 output rounding (2^-9) on CUDA;
# in float32 (unit roundoff 6e-8) K <= 200 products differ by ~sqrt(K) units (measured 2e-7)
RTOL = 1e-2 if CUDA else 1e-5


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if CUDA:
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


# -- the matmul -----------------------------------------------------------------------------
# 64-wide tiles with a bias; 128-wide tiles (past 2,048 columns), whole; 128-wide with a 4-column
# last tile and a K tail (200 = 3 x 64 + 8): what 4,100 columns checked, at half the interpreter time
@pytest.mark.parametrize("n,k,bias", [(130, 96, True), (2304, 64, False), (2052, 200, False)])
def test_matmul_rows_ignore_the_batch(n: int, k: int, bias: bool) -> None:
    from engine.kernels.matmul import linear

    g = _gen(0)
    x = torch.randn(140, k, device=DEVICE, generator=g).to(DTYPE)  # 64-row tiles, the last 12
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(DTYPE)
    b = torch.randn(n, device=DEVICE, generator=g).to(DTYPE) if bias else None
    full = linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float() if b is not None else None)
    assert rel_err(full, want) < RTOL
    for lo, hi in [(0, 1), (5, 6), (3, 67), (64, 65), (120, 140)]:
        assert same(linear(x[lo:hi], w, b), full[lo:hi]), (lo, hi)
    assert linear(x[:0], w, b).shape == (0, n)


# -- the norm -------------------------------------------------------------------------------
@pytest.mark.parametrize("with_x", [True, False])
def test_float32_residual_norm(with_x: bool) -> None:
    from engine.kernels.norm import add_rmsnorm

    g = _gen(1)
    res = torch.randn(37, 576, device=DEVICE, generator=g) * 3
    x = torch.randn(37, 576, device=DEVICE, generator=g).to(DTYPE) if with_x else None
    w = (1 + torch.randn(576, device=DEVICE, generator=g) / 10).to(DTYPE)
    want_res = res + x.float() if x is not None else res.clone()
    var = want_res.pow(2).mean(-1, keepdim=True)
    want = (w.float() * (want_res * torch.rsqrt(var + 1e-5))).to(DTYPE)
    got = add_rmsnorm(x, res, w, 1e-5)
    assert got.dtype == DTYPE and got.shape == want.shape
    assert torch.allclose(res, want_res, rtol=0, atol=1e-6)  # the stream, updated in place
    # bf16 output: 2^-9 = 2e-3, twice; float32: a 576-term sum of squares in another order,
    # a few units of 6e-8 (measured 5.6e-8), bounded at 1e-6
    assert rel_err(got, want) < (4e-3 if CUDA else 1e-6)


# -- the attention --------------------------------------------------------------------------
class PagedSetup:
    """A one-layer KV pool whose pages are handed out in shuffled order, and rows of a page
    table for requests of the given lengths; q, k and v are fixed random per position."""

    def __init__(self, heads: tuple[int, int, int], page_size: int, lengths: list[int]) -> None:
        self.hq, self.hk, self.d = heads
        self.page_size = page_size
        num_pages = sum(-(-n // page_size) for n in lengths) + 4
        self.pool = KVPool(1, num_pages, page_size, self.hk, self.d, DTYPE, DEVICE)
        self.table = PageTable(len(lengths), max(lengths), page_size)
        free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
        self.rows = []
        g = _gen(2)
        self.q, self.k, self.v = [], [], []
        for n in lengths:
            row = self.table.take_row()
            self.table.map_pages(row, 0, [free.pop() for _ in range(-(-n // page_size))])
            self.rows.append(row)
            self.q.append(torch.randn(n, self.hq, self.d, device=DEVICE, generator=g).to(DTYPE))
            self.k.append(torch.randn(n, self.hk, self.d, device=DEVICE, generator=g).to(DTYPE))
            self.v.append(torch.randn(n, self.hk, self.d, device=DEVICE, generator=g).to(DTYPE))

    def attend(self, backend: Any, spans: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One step over (request, start, end) spans: each writes K and V of [start, end) and
        attends from those positions; the output of each span, in order."""
        idx = [(self.rows[i], s, e) for i, s, e in spans]
        layout = BatchLayout(
            rows=[r for r, _, _ in idx],
            starts=[s for _, s, _ in idx],
            ends=[e for _, _, e in idx],
            out_loc=torch.cat([self.table.slots[r, s:e] for r, s, e in idx]).to(DEVICE),
            table=self.table,
        )
        q = torch.cat([self.q[i][s:e] for i, s, e in spans])
        k = torch.cat([self.k[i][s:e] for i, s, e in spans])
        v = torch.cat([self.v[i][s:e] for i, s, e in spans])
        out = backend.forward(q, k, v, 0, backend.prepare(layout))
        return list(out.split([e - s for _, s, e in spans]))

    def backend(self, name: str) -> Any:
        from engine.attention.torch_backend import TorchAttention
        from engine.attention.triton_backend import TritonAttention

        cls = TritonAttention if name == "triton" else TorchAttention
        return cls(self.pool, self.hq, self.hk, self.d)


HEADS = [(4, 2, 16), (9, 3, 64)] + ([(16, 8, 128)] if CUDA else [])


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_matches_torch_backend(heads: tuple[int, int, int], page_size: int) -> None:
    """Prefill, chunks after a cached prefix and decodes, in one mixed step."""
    setup = PagedSetup(heads, page_size, [37, 150, 201, 9, 130])
    prefix = [(1, 0, 80), (2, 0, 200), (3, 0, 8), (4, 0, 129)]
    step = [(0, 0, 37), (1, 80, 150), (2, 200, 201), (3, 8, 9), (4, 129, 130)]
    ref_backend, tri = setup.backend("torch"), setup.backend("triton")
    setup.attend(ref_backend, prefix)
    want = setup.attend(ref_backend, step)
    got = setup.attend(tri, step)  # writes the same K and V again, then attends
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert rel_err(g, w) < RTOL


@pytest.mark.parametrize("heads", HEADS[:2], ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_ignores_chunking_and_batch(heads: tuple[int, int, int], page_size: int) -> None:
    """A 150-token prompt prefilled whole, in uneven chunks, and one token at a time at the
    end, alone or beside other requests: every position's output has the same bits."""
    # 150 keys span three key blocks (64 each, the last partial) and pages of 16 at uneven
    # offsets; the interpreter's time grows with the square of the length
    setup = PagedSetup(heads, page_size, [150, 90, 40])
    tri = setup.backend("triton")
    whole = setup.attend(tri, [(0, 0, 150)])[0]
    pieces = []
    for s, e in [(0, 7), (7, 70), (70, 71), (71, 146)]:
        pieces.append(setup.attend(tri, [(0, s, e)])[0])
    # the rest beside a prefill and a chunk, then decoding beside another request's decode
    pieces.append(setup.attend(tri, [(1, 0, 90), (0, 146, 148), (2, 0, 33)])[1])
    pieces.append(setup.attend(tri, [(2, 33, 34), (0, 148, 149)])[1])
    pieces.append(setup.attend(tri, [(0, 149, 150), (2, 34, 35)])[0])
    assert same(torch.cat(pieces), whole)


# -- the engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    from checks.models import make_wide_model
    from tests.models import cached_tiny

    if CUDA:  # FlashInfer-sized heads and bf16 margins, as the other GPU tests
        return make_wide_model(tmp_path_factory.mktemp("bi-qwen3"), smollm2_dir)
    # In Triton's interpreter each program of 64 columns is a numpy pass, and a step costs what
    # its programs do: a 256-token vocabulary, heads of 16 and an MLP of 64 take 16 programs a
    # step where 49,152 / 32 / 128 took hundreds, through the same kernels and tile shapes
    # (64-column tiles, 64-row tiles, two layers).
    return cached_tiny("qwen3", smollm2_dir, vocab_size=VOCAB, head_dim=16, intermediate_size=64)


def _llm(path: Path, **kw: Any) -> Any:
    from engine import LLM

    args: dict[str, Any] = dict(
        device=DEVICE.type, batch_invariant=True, progress=False, max_seq_len=1024
    )
    if CUDA:
        args.update(num_pages=8192, max_running_req=16)
    return LLM(model=str(path), **{**args, **kw})


PROMPT_LENS = [(120, 230), (3, 40), (60, 61)] if CUDA else [(30, 60), (3, 12), (17, 18)]
VOCAB = 49152 if CUDA else 256


def _prompts(seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(*r))] for r in PROMPT_LENS]


def test_engine_is_exact_against_hf(tiny_model: Path) -> None:
    llm = _llm(tiny_model, max_extend_tokens=16, policy="mixed")
    assert llm.info.batch_invariant and llm.info.attention_backend == "triton"
    prompts = _prompts(0)
    # the long prompt's chunks run beside the others' decodes for three steps
    n = 4
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    got = [o["token_ids"] for o in llm.generate(prompts, params)]
    if CUDA:  # bf16 against HF float32: no divergence where HF had a clear winner
        ref = trace_run(_llm(tiny_model, batch_invariant=False), prompts, params)
        assert compare_greedy(ref, trace_run(llm, prompts, params), n)["mismatches"] == 0
    else:
        assert got == hf_greedy(tiny_model, prompts, n)


def test_chunked_batched_and_alone_give_the_same_bits(tiny_model: Path) -> None:
    """The logits of every sampled token, for prompts prefilled whole and all together, chunked
    at a small budget under either policy, and one request at a time: bit for bit equal."""
    prompts = _prompts(1)
    # a prompt's first token and two decodes, the decodes batched with each other
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # one engine for every run (the budget and the policy are live settings); without a prefix
    # cache each run computes every prompt again, on pages that earlier runs left in other places
    llm = _llm(tiny_model, max_extend_tokens=8192, cache_type="naive")
    whole = trace_run(llm, prompts, params)
    runs = {}
    for name, budget, policy in [("mixed, budget 7", 7, "mixed"),
                                 ("prefill_first, budget 16", 16, "prefill_first")]:  # fmt: skip
        llm.set_config(max_extend_tokens=budget, policy=policy)
        runs[name] = trace_run(llm, prompts, params)
    llm.set_config(max_extend_tokens=8192, policy="prefill_first")
    runs["alone"] = [trace_run(llm, [p], params)[0] for p in prompts]
    for name, run in runs.items():
        for a, b in zip(whole, run, strict=True):
            assert a.tokens == b.tokens, name
            for x, y in zip(a.logits, b.logits, strict=True):
                assert same(x, y), name


def test_prefix_cache_hit_gives_the_same_bits(tiny_model: Path) -> None:
    """A prompt whose first half is cached by an earlier request (radix cache) samples from the
    same logits as the prompt prefilled cold."""
    prompt = _prompts(2)[0]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    cold = trace_run(_llm(tiny_model, cache_type="naive"), [prompt], params)[0]
    warm_llm = _llm(tiny_model, max_extend_tokens=16)
    # the earlier request's own output does not matter: one token
    trace_run(warm_llm, [prompt[: len(prompt) // 2]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert warm_llm.kv_stats().cached > 0
    warm = trace_run(warm_llm, [prompt], params)[0]
    assert all(same(x, y) for x, y in zip(cold.logits, warm.logits, strict=True))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_cuda_graph_decode_gives_the_eager_bits(tiny_model: Path) -> None:
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    graph = _llm(tiny_model)
    eager = _llm(tiny_model, cuda_graph=False)
    assert graph.runner.graphs is not None and eager.runner.graphs is None
    a, b = trace_run(eager, prompts, params), trace_run(graph, prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        assert all(torch.equal(p, q) for p, q in zip(x.logits, y.logits, strict=True))


def test_bad_combinations_are_refused() -> None:
    from engine.config import EngineConfig
    from instrumentation.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="batch_invariant runs the triton"):
        EngineConfig(batch_invariant=True, attention_backend="flashinfer")
    with pytest.raises(InvalidRequest, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant="yes")  # type: ignore[arg-type]


def test_without_cuda_or_interpreter_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import triton_unavailable

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "need CUDA" in (triton_unavailable("cpu") or "")
    assert triton_unavailable("cuda") is None
    if not CUDA:
        from engine import LLM
        from instrumentation.errors import InvalidRequest

        for kw in ({"batch_invariant": True}, {"attention_backend": "triton"}):
            with pytest.raises(InvalidRequest, match="needs the Triton kernels: Triton kernels"):
                LLM(model="smollm2", progress=False, **kw)
