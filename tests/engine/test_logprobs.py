"""Logprobs from the engine against Hugging Face's logits on the same weights: of sampled tokens
with their top alternatives, and of every prompt token (a prompt computed whole, chunked across
steps, never served from the prefix cache). And min_p in the sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from instrumentation.sampling import SamplingParams
from tests.helpers import _hf_model


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_and_output_logprobs_are_the_models(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), max_extend_tokens=8, progress=False)  # 13 tokens: 2 chunks
    ids = llm.encode("river stone light quiet seven paper north glass bread river stone")
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    # the second run's prompt is in the prefix cache: it must still be computed whole
    for out in llm.generate([ids], params) + llm.generate([ids], params):
        assert out["cached_len"] == 0
        full = ids + out["token_ids"]
        ref = hf_logprobs(tiny_llama_dir, full)
        rows = out["prompt_logprobs"] + out["logprobs"]
        assert len(out["prompt_logprobs"]) == len(ids) - 1 and len(out["logprobs"]) == 4
        for pos, (lp, top) in enumerate(rows):  # row `pos` is token pos + 1, predicted at pos
            assert lp == pytest.approx(ref[pos, full[pos + 1]].item(), abs=1e-3)
            k = 2 if pos < len(ids) - 1 else 3
            assert [t for t, _ in top] == ref[pos].topk(k).indices.tolist()
            assert [v for _, v in top] == pytest.approx(ref[pos].topk(k).values.tolist(), abs=1e-3)
    plain = llm.generate([ids], SamplingParams(max_tokens=2))[0]
    assert "logprobs" not in plain and plain["cached_len"] > 0  # the cache serves the others


def test_min_p_one_is_greedy_and_min_p_zero_samples(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False)
    ids = llm.encode("seven paper north glass")
    greedy = llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]["token_ids"]
    hot = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=2.0, seed=s, min_p=1.0)
           for s in range(3)]  # fmt: skip
    assert all(o["token_ids"] == greedy for o in llm.generate([ids] * 3, hot))
    free = [
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=2.0, seed=s) for s in range(3)
    ]
    assert any(o["token_ids"] != greedy for o in llm.generate([ids] * 3, free))
