"""hf and hf_static: Hugging Face generate with its default cache and with a static cache
(compiled by generate on first use), the bench's shapes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from transformers import LogitsProcessor

from scripts.gpu_check import common
from scripts.gpu_check.common import BATCHES, NEW_TOKENS, PROMPT_LEN, QWEN, QWEN_VOCAB, free
from scripts.gpu_check.report import Report


class StepClock(LogitsProcessor):
    """A logits processor that timestamps every generation step (after a device sync)."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        self.t.append(time.perf_counter())
        return scores


def hf_generate(model: Any, bs: int, **kw: Any) -> dict[str, float]:
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


def hf_model() -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(common.DEV):
        return AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(QWEN), dtype=torch.bfloat16
        ).eval()


def sec_hf(r: Report) -> None:
    hf_section(r, None, list(BATCHES))


def sec_hf_static(r: Report, batches: list[int]) -> None:
    hf_section(r, "static", batches)


def hf_section(r: Report, cache: str | None, batches: list[int]) -> None:
    """Hugging Face `generate` with its default cache (None) or the static one, which compiles
    on its first call: that call is timed apart and the second one measured."""
    model = hf_model()
    kw = {} if cache is None else {"cache_implementation": cache}
    rows, raw = [], {}
    for bs in batches:
        if r.left() < (40 if cache is None else 150):
            r.say(f"(skipped HF {cache or 'default'} cache at batch {bs}: out of time)")
            continue
        label = "default (dynamic)"
        if cache is not None:
            t = time.perf_counter()
            hf_generate(model, bs, **kw)
            first = time.perf_counter() - t
            label = f"{cache} (first call {first:.0f} s)"
        res = hf_generate(model, bs, **kw)
        if cache is not None:
            res["first_call_s"] = first
        raw[bs] = res
        row = [res["step_ms_mean"], res["step_ms_median"], res["decode_tok_s"], res["e2e_tok_s"]]
        rows.append([label, bs, *row])
        print(bs, res, flush=True)
        r.data["hf" if cache is None else f"hf_{cache}"] = raw
    _hf_table(r, cache or "default", rows)
    del model
    free()


def _hf_table(r: Report, cache: str, rows: list[list[Any]]) -> None:
    r.table(
        f"Hugging Face generate, {cache} cache, same shapes (bf16, sdpa)",
        [
            "cache",
            "batch",
            "step ms (mean)",
            "step ms (median)",
            "decode tok/s",
            "end-to-end tok/s",
        ],
        rows,
    )
