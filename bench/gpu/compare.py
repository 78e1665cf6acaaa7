"""The comparisons of the exactness section, on any model it builds: greedy tokens chunked and
unchunked, logits per step kind between two attention backends, logits against Hugging Face."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.common import free, rand_ids
from bench.gpu.hf import logits_rows, logits_rows_hf
from checks.greedy import LogitTap, compare_greedy, rel_err, trace_run
from engine import LLM
from instrumentation.sampling import SamplingParams

CHUNK_PROMPTS = 32  # prompts of the chunked-against-unchunked comparison
BACKEND_HEADERS = ["model", "step kind", "steps compared", "worst relative error of logits"]
CHUNK_HEADERS = ["model", "chunked run", "prompts", "same tokens", "diverged at a near-tie",
                 "diverged (clear winner)", "worst logits rel. error before divergence"]  # fmt: skip
LOGITS_HEADERS = ["model", "step", "FlashInfer + graphs vs HF fp32",
                  "FlashInfer + graphs vs HF bf16", "torch attention vs HF fp32",
                  "float32 residual vs HF fp32", "batch-invariant, float32 residual, vs HF fp32",
                  "HF bf16 vs HF fp32 (yardstick)"]  # fmt: skip


def chunk_rows(llm: LLM, prompts: list[list[int]], name: str) -> list[list[Any]]:
    """Greedy tokens unchunked (budget 8192) against three chunked runs of the same engine."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm.set_config(max_extend_tokens=8192, policy="prefill_first")
    whole = trace_run(llm, prompts, params)
    rows = []
    for policy, budget in (("prefill_first", 128), ("mixed", 128), ("prefill_first", 64)):
        llm.set_config(max_extend_tokens=budget, policy=policy)
        c = compare_greedy(whole, trace_run(llm, prompts, params), 32)
        rows.append([name, f"{policy}, budget {budget}", len(prompts), c["same"], c["ties"],
                     c["mismatches"], c["worst_rel_err"]])  # fmt: skip
    return rows


def phase_trace(llm: LLM, prompts: list[list[int]], late: list[int]) -> list[tuple[str, Any]]:
    """(phase, logits) of every sampling step of a workload that has prefill, mixed and decode
    steps: two prompts start, then a long one arrives while they decode (policy mixed)."""
    llm.set_config(max_extend_tokens=256, policy="mixed")
    steps: list[tuple[str, Any]] = []
    for p in prompts:
        llm.submit(p, SamplingParams(max_tokens=16, ignore_eos=True))
    with LogitTap() as tap:
        n = 0
        while llm.has_work():
            if n == 3:
                llm.submit(late, SamplingParams(max_tokens=4, ignore_eos=True))
            record = llm.step()
            n += 1
            logits = tap.rows_of(record)
            if logits is not None:
                steps.append((record.phase, logits))
    return steps


def compare_phases(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> dict[str, list[float]]:
    """Relative error per phase, up to the first step whose greedy tokens differ."""
    errs: dict[str, list[float]] = {}
    for (pa, la), (pb, lb) in zip(a, b, strict=False):
        if pa != pb or la.shape != lb.shape:
            break
        errs.setdefault(pa, []).append(rel_err(lb, la))
        if not torch.equal(la.argmax(-1), lb.argmax(-1)):
            break
    return errs


def backend_rows(name: str, make: Callable[..., LLM], vocab: int, seed: int) -> list[list[Any]]:
    """FlashInfer (with graphs) against torch attention (eager) inside the same engine."""
    rng = random.Random(seed)
    prompts, late = (
        [rand_ids(100, rng, vocab), rand_ids(150, rng, vocab)],
        rand_ids(700, rng, vocab),
    )
    fi = make(max_running_req=16)
    a = phase_trace(fi, prompts, late)
    del fi
    free()
    ref = make(max_running_req=16, attention_backend="torch", cuda_graph=False)
    b = phase_trace(ref, prompts, late)
    del ref
    free()
    return [[name, phase, len(errs), max(errs)] for phase, errs in compare_phases(b, a).items()]


def logits_table_rows(
    name: str, make: Callable[..., LLM], hf32: Any, hf16: Any, prompts: list[list[int]], vocab: int
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
        [name, k, res[f"fp32 {k}"], res[f"bf16 {k}"], tres[f"fp32 {k}"], wres[f"fp32 {k}"],
         ires[f"fp32 {k}"], yard[k]]
        for k in ("prefill", "decode")
    ]  # fmt: skip
    return rows, {**raw, "hf_bf16_vs_fp32": yard}
