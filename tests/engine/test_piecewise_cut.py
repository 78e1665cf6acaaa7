"""The piecewise graphs' plumbing (engine/piecewise_graph.py), on CPU: the capture needs CUDA,
but the cut does not. A forward through `CutAtAttention`, padded to a captured token count, with
attention run at each cut over the real tokens into the shared output buffer (what a replay
does between two pieces), gives the plain forward's hidden states and K/V cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.piecewise_graph import CutAtAttention, token_buckets


def test_token_buckets_cover_every_count_with_bounded_padding() -> None:
    sizes = token_buckets(4096)
    assert sizes == sorted(set(sizes)) and sizes[0] == 8 and sizes[-1] == 4096
    for t in range(1, 4097):
        g = next(s for s in sizes if s >= t)
        # padding: under the step itself to 128 tokens, under 64 to 1,024, under 256 beyond
        bound = max(7, t - 1) if t <= 128 else 63 if t <= 1024 else 255
        assert g - t <= bound, (t, g)
    assert token_buckets(100) == [8, 16, 32, 48, 64, 96, 100]
    assert token_buckets(8) == [8]


@pytest.mark.parametrize("n", [5, 37])
def test_forward_cut_at_attention_gives_the_plain_forward(tiny_qwen3_dir: Path, n: int) -> None:
    from engine import LLM
    from engine.attention.base import BatchLayout

    llm = LLM(str(tiny_qwen3_dir), device="cpu", cache_type="naive", progress=False)
    model, backend, pool, table = llm.model, llm.runner.backend, llm.pool, llm.table
    g = next(s for s in token_buckets(64) if s >= n)
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(3, llm.model_config.vocab_size, (n,), generator=gen)
    positions = torch.arange(n)
    slots = torch.arange(n) + 3 * pool.page_size  # not page 0: padding lands on the spare page
    table.slots[0, :n] = slots
    layout = BatchLayout([0], [0], [n], slots, table)
    with torch.inference_mode():
        meta = backend.prepare(layout)
        want = model(ids, positions, backend, meta)
        want_k, want_v = pool.k.clone(), pool.v.clone()
        pool.k.zero_()
        pool.v.zero_()

        heads, dim = model.num_heads, model.config.head_dim
        queries = torch.zeros(64, heads, dim)
        attn_out = torch.full_like(queries, float("nan"))  # rows past n: never read as real
        attn_out[:n] = 0
        pad_slot = llm.num_pages * pool.page_size
        io_slots = torch.cat([slots, torch.full((g - n,), pad_slot)])
        cut = CutAtAttention(backend, queries, attn_out, lambda k: io_slots[:k])
        cut.tokens = g
        cuts: list[int] = []

        def attend(layer: int) -> None:  # what a replay runs between two pieces
            cuts.append(layer)
            attn_out[:n] = backend.attend(queries[:n], layer, meta)

        cut.cut = attend
        attn_out[n:g] = 0  # the padding rows' output: whatever the last step left, finite
        padded_ids = torch.cat([ids, torch.zeros(g - n, dtype=ids.dtype)])
        padded_pos = torch.cat([positions, torch.zeros(g - n, dtype=positions.dtype)])
        got = model(padded_ids, padded_pos, cut, None)[:n]
    assert cuts == list(range(llm.model_config.num_layers))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    real = slice(slots[0].item(), slots[-1].item() + 1)
    torch.testing.assert_close(pool.k[:, real], want_k[:, real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.v[:, real], want_v[:, real], rtol=1e-5, atol=1e-5)
