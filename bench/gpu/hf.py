"""Hugging Face as the yardstick: `generate` timed step by step (the decode section), and models
holding the engine's own weights whose logits the exactness section compares against.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor

from bench.gpu import common
from bench.gpu.common import NEW_TOKENS, PROMPT_LEN, QWEN, QWEN_VOCAB, rand_ids
from checks.greedy import rel_err, trace_run
from engine import LLM
from instrumentation.sampling import SamplingParams


class StepClock(LogitsProcessor):
    """A logits processor that timestamps every generation step (after a device sync)."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        self.t.append(time.perf_counter())
        return scores


def random_qwen() -> Any:
    """Hugging Face's model of Qwen3-0.6B's shape, random bf16 weights, on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(common.DEV):
        return AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(QWEN), dtype=torch.bfloat16
        ).eval()


def hf_generate(model: Any, bs: int, **kw: Any) -> dict[str, float]:
    """`generate` of `bs` random PROMPT_LEN-token prompts, NEW_TOKENS each: step times."""
    from transformers import LogitsProcessorList

    ids = torch.randint(3, QWEN_VOCAB, (bs, PROMPT_LEN), device=common.DEV)
    clock = StepClock()
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
            **kw,
        )
    total = time.perf_counter() - t
    gaps = [b - a for a, b in zip(clock.t, clock.t[1:], strict=False)]
    return {
        "step_ms_median": statistics.median(gaps) * 1e3,
        "step_ms_mean": statistics.fmean(gaps) * 1e3,
        "decode_tok_s": bs / statistics.fmean(gaps),
        "e2e_tok_s": bs * NEW_TOKENS / total,
        "total_s": total,
    }


def hf_from_engine(llm: LLM, dtype: torch.dtype, config_dir: Path) -> Any:
    """A Hugging Face model holding the engine's weights (merged projections split back)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device(common.DEV):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    m = llm.model_config
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    state: dict[str, torch.Tensor] = {}
    for name, p in llm.model.named_parameters():
        w = p.detach().to(dtype)
        if ".qkv_proj." in name:
            for part, rows in (
                ("q_proj", (0, q)),
                ("k_proj", (q, q + kv)),
                ("v_proj", (q + kv, None)),
            ):
                state[name.replace("qkv_proj", part)] = w[rows[0] : rows[1]]
        elif ".gate_up_proj." in name:
            gate, up = w.chunk(2, dim=0)
            state[name.replace("gate_up_proj", "gate_proj")] = gate
            state[name.replace("gate_up_proj", "up_proj")] = up
        else:
            state[name] = w
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if "lm_head.weight" in missing:  # tied: the embedding is the LM head
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.eval()


def hf_logits(model: Any, ids: list[int], last: int) -> torch.Tensor:
    """The logits of the last `last` positions of `ids`, float32 on the CPU."""
    with torch.inference_mode():
        return (
            model(input_ids=torch.tensor([ids], device=common.DEV)).logits[0, -last:].float().cpu()
        )


def bf16_rounded(model: Any) -> Any:
    """A float32 model's weights rounded to bf16 and back: float32 arithmetic on bf16 weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def logits_rows(
    llm: LLM, refs: dict[str, Any], prompts: list[list[int]], new: int = 8
) -> dict[str, float]:
    """Worst relative error of the engine's logits against each reference model, split into the
    prefill's last position and the decode steps after it (CUDA graphs on the engine side)."""
    worst: dict[str, float] = {}
    for prompt in prompts:
        tr = trace_run(llm, [prompt], SamplingParams(max_tokens=new, ignore_eos=True))[0]
        got = torch.stack(tr.logits)
        ids = prompt + tr.tokens
        for ref_name, ref in refs.items():
            want = hf_logits(ref, ids[:-1], len(tr.tokens))
            for kind, sl in (("prefill", slice(0, 1)), ("decode", slice(1, None))):
                err = max(rel_err(g, w) for g, w in zip(got[sl], want[sl], strict=True))
                key = f"{ref_name} {kind}"
                worst[key] = max(worst.get(key, 0.0), err)
    return worst


def logits_rows_hf(
    hf16: Any, hf32: Any, prompts: list[list[int]], vocab: int, new: int = 8
) -> dict[str, float]:
    """HF bf16 against HF fp32 on the same positions: what bf16 alone costs."""
    worst = {"prefill": 0.0, "decode": 0.0}
    for prompt in prompts:
        ids = prompt + rand_ids(new - 1, random.Random(len(prompt)), vocab)
        a, b = hf_logits(hf16, ids, new), hf_logits(hf32, ids, new)
        worst["prefill"] = max(worst["prefill"], rel_err(a[0], b[0]))
        worst["decode"] = max(
            worst["decode"], max(rel_err(x, y) for x, y in zip(a[1:], b[1:], strict=True))
        )
    return worst
