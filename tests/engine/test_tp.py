"""Tensor parallelism on CPU: two processes over gloo give the single-process engine's greedy
tokens, whatever the budget, the policy, the page size or the overlap; the step records carry
each rank's time; a rank that dies ends the engine with a clear error.

The all-reduce adds the ranks' partial sums in another order than one matmul does, so float32
results differ in the last bits: the tiny models' weights are drawn with wide margins, and
SmolLM2 is compared on a few short prompts. One TP engine serves every budget and policy of a
model (`set_config`), since starting the second process costs seconds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.parallel import HeadShard, Sections, copy_part, head_shard, split, take
from instrumentation.errors import InvalidRequest

N_OUT = 4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 49152, (12,), generator=g).tolist()
    return [
        torch.randint(3, 49152, (19,), generator=g).tolist(),
        torch.randint(3, 49152, (3,), generator=g).tolist(),
        shared + torch.randint(3, 49152, (5,), generator=g).tolist(),
        shared + torch.randint(3, 49152, (9,), generator=g).tolist(),  # a radix hit on 12
    ]


def _greedy(llm: LLM, prompts: list, max_tokens: int = N_OUT) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(prompts, params)]


def _check_budgets(tp: LLM, prompts: list, ref: list[list[int]], plan: dict[str, list[int]]):
    for policy, budgets in plan.items():
        for budget in budgets:
            tp.set_config(max_extend_tokens=budget, policy=policy)
            assert _greedy(tp, prompts) == ref, f"budget={budget} policy={policy}"
            tp.check_integrity()
    # again, from the prefix cache's pages: rank 0 sends the other ranks the cached prefixes'
    # page-table entries
    assert _greedy(tp, prompts) == ref
    assert tp.kv_stats().used == 0


# -- the split itself (no processes) ---------------------------------------------------------
def test_heads_are_dealt_by_whole_groups() -> None:
    # SmolLM2: 9 query heads in 3 groups over 2 ranks, unevenly
    assert head_shard(9, 3, 2, 0) == HeadShard(0, 6, 0, 2)
    assert head_shard(9, 3, 2, 1) == HeadShard(6, 3, 2, 1)
    # fewer KV heads than ranks: each KV head on two ranks, its queries split between them
    assert [head_shard(4, 2, 4, r) for r in range(4)] == [
        HeadShard(0, 1, 0, 1),
        HeadShard(1, 1, 0, 1),
        HeadShard(2, 1, 1, 1),
        HeadShard(3, 1, 1, 1),
    ]
    with pytest.raises(ValueError, match="divide or be a multiple"):
        head_shard(4, 2, 3, 0)
    with pytest.raises(ValueError, match="without query heads"):
        head_shard(4, 2, 8, 0)
    assert [split(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]


def test_rank_slices_of_fused_weights_load_from_their_parts() -> None:
    """Loading q, k and v separately into a rank's fused QKV gives the rank's slices of the
    whole fused tensor, which is what dummy weights take."""
    from engine.models.config import ModelConfig
    from engine.models.parallel import ShardLayout, TPRank

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=11, hidden_size=8, intermediate_size=6,
        num_layers=1, num_heads=9, num_kv_heads=3, head_dim=2, rms_norm_eps=1e-5,
        rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=False, qk_norm=False, qkv_bias=False, eos_token_ids=(),
    )  # fmt: skip
    q, kv = cfg.num_heads * 2, cfg.num_kv_heads * 2
    whole = torch.randn(q + 2 * kv, 8)
    rows = []
    for rank in range(2):
        s = ShardLayout.of(cfg, TPRank(rank, 2)).sections("layers.0.self_attn.qkv_proj.weight")
        assert s is not None
        local = torch.zeros(sum(b - a for a, b in s.ranges), 8)
        for off, n in ((0, q), (q, kv), (q + kv, kv)):
            copy_part(local, whole[off : off + n], off, s)
        assert torch.equal(local, take(whole, s))
        rows.append(local.shape[0])
    assert rows == [(6 + 2 * 2) * 2, (3 + 2 * 1) * 2]
    # the vocabulary: equal row counts, the last rank's tail past the vocabulary left out
    v = ShardLayout.of(cfg, TPRank(1, 2))
    assert (v.vocab_start, v.vocab_rows) == (6, 6)
    assert v.sections("lm_head.weight") == Sections(0, 11, ((6, 11),))


def test_other_ranks_tables_follow_rank_0s() -> None:
    """The entries each step sends bring another rank's copy of the page table to rank 0's for
    every row the step uses: only new positions, and all again when a row changes hands."""
    from types import SimpleNamespace

    from engine.kvcache.table import PageTable
    from engine.kvcache.table_sync import TableSync, apply_updates

    table, copy, sync = PageTable(3, 32, 4), PageTable(3, 32, 4), TableSync()

    def step(*reqs: SimpleNamespace) -> int:
        spans, slots = sync.updates(list(reqs), table)  # type: ignore[arg-type]
        apply_updates(copy, spans, slots)
        for r in reqs:
            row, end = r.table_idx, r.device_len
            assert torch.equal(copy.slots[row, :end], table.slots[row, :end])
        return len(slots)

    a = SimpleNamespace(tenancy=(1, 0), table_idx=0, device_len=10)
    c = SimpleNamespace(tenancy=(3, 0), table_idx=2, device_len=3)
    table.map_pages(0, 0, [5, 2, 7])
    table.map_pages(2, 0, [4])
    assert step(a, c) == 13
    a.device_len, c.device_len = 11, 4
    assert step(a, c) == 2  # decodes: one entry each
    b = SimpleNamespace(tenancy=(2, 0), table_idx=0, device_len=6)  # row 0 changes hands
    table.map_pages(0, 0, [1, 3])
    assert step(b) == 6
    # request 3, retracted and admitted again into its old row: other pages, all sent again
    c.tenancy, c.device_len = (3, 1), 4
    table.map_pages(2, 0, [6])
    assert step(c) == 4


def test_bad_tp_sizes_are_refused(tiny_llama_dir) -> None:
    with pytest.raises(InvalidRequest, match="tp_size must be an integer"):
        LLM(str(tiny_llama_dir), tp_size=0, progress=False)
    with pytest.raises(InvalidRequest, match="batch_invariant needs tp_size=1"):
        LLM(str(tiny_llama_dir), tp_size=2, batch_invariant=True, progress=False)
    # 2 KV heads on 3 ranks: refused before any process starts
    with pytest.raises(InvalidRequest, match="divide or be a multiple"):
        LLM(str(tiny_llama_dir), tp_size=3, progress=False)


def test_server_takes_tp_size() -> None:
    from engine.server import build_parser

    assert build_parser().parse_args(["--tp-size", "2"]).tp_size == 2
    assert build_parser().parse_args([]).tp_size == 1


# -- two processes over gloo -----------------------------------------------------------------
def test_tiny_llama_tp2_matches_tp1_and_a_dead_rank_ends_it(tiny_llama_dir) -> None:
    prompts = _prompts()
    kw = dict(max_running_req=4, progress=False)
    ref = _greedy(LLM(str(tiny_llama_dir), **kw), prompts)
    threads = torch.get_num_threads()
    tp = LLM(str(tiny_llama_dir), tp_size=2, **kw)
    try:
        assert tp.info.tp_size == 2 and tp.info.to_dict()["tp_size"] == 2
        records: list[dict] = []
        tp.add_step_hook(lambda rec: records.append(rec.to_dict()))
        _check_budgets(tp, prompts, ref, {"prefill_first": [2, 8192], "mixed": [3]})
        # every step says what each rank spent on it
        for rec in records:
            ranks = rec["ranks"]
            assert [r["rank"] for r in ranks] == [0, 1]
            for r in ranks:
                assert r["forward_s"] > 0 and 0 <= r["comm_s"] <= r["forward_s"]

        # a rank that dies ends the engine with a clear error, not a hang
        os.kill(tp.leader.procs[0].pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(Exception, match=r"rank 1 .*ended with signal 9"):
            _greedy(tp, prompts[:1])
        assert time.monotonic() - t < 10
    finally:
        tp.close()
    assert torch.get_num_threads() == threads  # the process's own count is back


def test_tiny_qwen3_tp2_pages_of_4_with_overlap(tiny_qwen3_dir) -> None:
    prompts = _prompts()
    kw = dict(max_running_req=4, page_size=4, cache_type="radix", progress=False)
    ref = _greedy(LLM(str(tiny_qwen3_dir), **kw), prompts)
    # overlap: rank 0 broadcasts each step's sampled tokens, the next step's inputs on every
    # rank are patched from them
    tp = LLM(str(tiny_qwen3_dir), tp_size=2, overlap=True, **kw)
    try:
        _check_budgets(tp, prompts, ref, {"prefill_first": [8192], "mixed": [6]})
    finally:
        tp.close()


def test_uneven_heads_tp2_matches_tp1(smollm2_dir) -> None:
    """SmolLM2's head layout (9 query heads, 3 KV heads) on 2 ranks: rank 0 holds 2 KV heads (6
    query heads), rank 1 holds 1. A tiny random Llama of that layout: loading SmolLM2 in each
    rank was most of this test's time."""
    from tests.models import cached_tiny

    path = cached_tiny("llama", smollm2_dir, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=16, hidden_size=144)  # fmt: skip
    prompts = _prompts()
    kw = dict(max_running_req=4, max_extend_tokens=8192, progress=False)
    ref = _greedy(LLM(str(path), **kw), prompts)
    tp = LLM(str(path), tp_size=2, **kw)
    try:
        assert (tp.model.num_heads, tp.model.num_kv_heads) == (6, 2)
        assert _greedy(tp, prompts) == ref
        # chunks of the long prompt alongside the short ones' decodes
        tp.set_config(max_extend_tokens=16, policy="mixed")
        assert _greedy(tp, prompts) == ref
    finally:
        tp.close()
