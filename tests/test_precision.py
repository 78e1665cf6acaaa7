"""The float32 residual stream (`residual_dtype="float32"`): in bfloat16 it brings the logits
closer to the same weights computed in float32 than the usual bfloat16 stream (Hugging Face's
layout), here on CPU, where bfloat16 matmuls also accumulate in float32."""

from __future__ import annotations

import random

import pytest
import torch

import engine.runner as runner
from engine import LLM, SamplingParams


def last_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits each prompt's first token is sampled from."""
    rows: list[torch.Tensor] = []
    sample = runner.sample_tokens

    def tapped(logits: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(logits[0].float().clone())
        return sample(logits, *args)  # type: ignore[arg-type]

    runner.sample_tokens = tapped
    try:
        for p in prompts:
            llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        runner.sample_tokens = sample
    return rows


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


@pytest.mark.slow
def test_float32_residual_stream_halves_the_bf16_error(smollm2_dir) -> None:
    kw = dict(model="smollm2", max_seq_len=512, num_pages=2048, max_running_req=2, progress=False)
    plain = LLM(dtype="bfloat16", **kw)  # type: ignore[arg-type]
    wide = LLM(dtype="bfloat16", residual_dtype="float32", **kw)  # type: ignore[arg-type]
    ref = LLM(dtype="float32", **kw)  # type: ignore[arg-type]
    weights = plain.model.state_dict()
    wide.model.load_state_dict(weights)
    ref.model.load_state_dict({k: v.float() for k, v in weights.items()})
    assert wide.info.residual_dtype == "float32" and plain.info.residual_dtype == "bfloat16"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (16, 100, 300, 450)]
    truth = last_logits(ref, prompts)
    err_plain = [rel_err(a, r) for a, r in zip(last_logits(plain, prompts), truth, strict=True)]
    err_wide = [rel_err(a, r) for a, r in zip(last_logits(wide, prompts), truth, strict=True)]
    assert max(err_wide) <= 1e-2, err_wide
    assert sum(err_wide) <= 0.5 * sum(err_plain), (err_wide, err_plain)
