"""Greedy output is identical to Hugging Face on the same weights, whatever the budget, page size,
prefix cache or policy: chunking and mixing change the order of work, never the result."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.helpers import CHAPTER_PROMPTS, LONG, hf_greedy

N_OUT = 5


def _random_prompts(seed: int) -> list[list[int]]:
    # long enough that every budget below but 8192 splits the prompts over steps, and that pages of
    # 4 fill and spill over; at budget 1 each prompt token is a step of its own
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(18)]
    return [
        [rng.randrange(3, 49152) for _ in range(29)],
        [rng.randrange(3, 49152) for _ in range(5)],
        shared + [rng.randrange(3, 49152) for _ in range(5)],
        shared + [rng.randrange(3, 49152) for _ in range(13)],  # shares 18 tokens with the last
        [rng.randrange(3, 49152) for _ in range(1)],
    ]


def _check(llm: LLM, prompts: list, ref: list[list[int]], budgets: list[int], policy: str) -> None:
    for budget in budgets:
        llm.set_config(max_extend_tokens=budget, policy=policy)
        out = llm.generate(prompts, SamplingParams(max_tokens=N_OUT, ignore_eos=True))
        got = [o["token_ids"] for o in out]
        assert got == ref, f"budget={budget} policy={policy}"
        llm.check_integrity()
    assert llm.kv_stats().used == 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_tiny_models_match_hf(model: str, cache_type: str, page_size: int, request) -> None:
    path = request.getfixturevalue(model)
    prompts = _random_prompts(1)
    ref = hf_greedy(path, prompts, N_OUT)
    llm = LLM(
        str(path), page_size=page_size, cache_type=cache_type, max_running_req=4, progress=False
    )
    # run twice per budget: the second pass reuses the radix cache's pages
    _check(llm, prompts, ref, [1, 6, 16, 8192, 16], "prefill_first")
    _check(llm, prompts, ref, [2, 7, 64], "mixed")


def test_tiny_qwen2_matches_hf(smollm2_dir) -> None:
    from tests.models import cached_tiny

    path = cached_tiny("qwen2", smollm2_dir)
    prompts = _random_prompts(2)
    ref = hf_greedy(path, prompts, N_OUT)
    llm = LLM(str(path), page_size=4, max_running_req=4, progress=False)
    _check(llm, prompts, ref, [6, 8192], "prefill_first")
    _check(llm, prompts, ref, [7], "mixed")


@pytest.mark.slow
# one worker builds the engine these tests share (tests/engine/conftest.py)
@pytest.mark.xdist_group("smollm2")
def test_smollm2_matches_hf(smollm2_dir, smollm2_llm: LLM) -> None:
    # The real model once: chunked (every prompt computed in chunks of 6), then served from the
    # radix cache, then mixed with decodes. The grid of budgets, page sizes, caches and policies
    # runs on the tiny models above: the same code paths at a fiftieth of the cost.
    llm = smollm2_llm
    assert (llm.info.page_size, llm.info.cache_type) == (4, "radix")
    prompts = [*CHAPTER_PROMPTS, LONG + "And then"]
    ids = [llm.tokenizer(p).input_ids for p in prompts]
    ref = hf_greedy(smollm2_dir, ids, N_OUT)
    _check(llm, prompts, ref, [6, 8192], "prefill_first")
    _check(llm, prompts, ref, [7], "mixed")


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_chat_answer(smollm2_llm: LLM) -> None:
    out = smollm2_llm.generate(
        ["What is the capital of France?"], SamplingParams(max_tokens=20), chat=True
    )
    assert out[0]["text"] == "The capital of France is Paris."
    assert out[0]["finish_reason"] == "eos"
