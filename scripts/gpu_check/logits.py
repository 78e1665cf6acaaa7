"""logits: engine vs Hugging Face, last-position logits, Qwen3-0.6B shape with random weights."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from engine import LLM
from engine.checks.greedy import (
    rel_err,
)
from scripts.gpu_check.common import (
    LOGITS_HEADERS,
    QWEN,
    QWEN_VOCAB,
    free,
    hf_from_engine,
    hf_logits,
    logits_rows,
    qwen_engine,
    rand_ids,
)
from scripts.gpu_check.report import Report


def logits_table_rows(
    name: str,
    make: Callable[..., LLM],
    hf32: Any,
    hf16: Any,
    prompts: list[list[int]],
    vocab: int,
) -> tuple[list[list[Any]], dict[str, Any]]:
    """The engine's variants (FlashInfer with graphs; torch attention; a float32 residual;
    batch-invariant with a float32 residual) against HF fp32, the first also against HF bf16."""
    variants: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "flashinfer": ({}, {"fp32": hf32, "bf16": hf16}),
        "torch": ({"attention_backend": "torch", "cuda_graph": False}, {"fp32": hf32}),
        "wide": ({"residual_dtype": "float32"}, {"fp32": hf32}),
        "invariant": ({"residual_dtype": "float32", "batch_invariant": True}, {"fp32": hf32}),
    }
    raw: dict[str, Any] = {}
    for key, (kw, refs) in variants.items():
        llm = make(**kw)
        raw[key] = logits_rows(llm, refs, prompts)
        del llm
        free()
    res, tres, wres, ires = (raw[k] for k in variants)
    yard = logits_rows_hf(hf16, hf32, prompts, vocab)
    rows = [
        [name, k]
        + [res[f"fp32 {k}"], res[f"bf16 {k}"], tres[f"fp32 {k}"], wres[f"fp32 {k}"]]
        + [ires[f"fp32 {k}"], yard[k]]
        for k in ("prefill", "decode")
    ]
    return rows, {**raw, "hf_bf16_vs_fp32": yard}


def sec_logits(r: Report) -> None:
    llm = qwen_engine(max_running_req=16, num_pages=16384)
    hf32 = hf_from_engine(llm, torch.float32, QWEN)
    hf16 = hf_from_engine(llm, torch.bfloat16, QWEN)
    del llm
    prompts = [rand_ids(n, random.Random(n), QWEN_VOCAB) for n in (16, 512, 1500)]
    rows, raw = logits_table_rows(
        "Qwen3-0.6B shape, random",
        lambda **kw: qwen_engine(max_running_req=16, num_pages=16384, **kw),
        hf32,
        hf16,
        prompts,
        QWEN_VOCAB,
    )
    r.data["logits_qwen3"] = raw
    r.table("Logits against Hugging Face on the same (bf16) weights", LOGITS_HEADERS, rows)
    r.say(
        "Relative error = ||engine - HF|| / ||HF|| of one position's logits, worst over prompts of "
        "16, 512 and 1500 tokens (prefill: the prompt's last position; decode: the 7 steps after "
        "it); target <= 1e-2."
    )
    del hf32, hf16
    free()


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
