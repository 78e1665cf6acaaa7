"""kernels: the fused kernels' tuning tables (kernel_tuning.py), then a decode step's kernels
at batch 1 and 64 (torch.profiler, through the CUDA graphs) with the fused decode kernels off,
on without programmatic dependent launch, and on: per class, the time, bytes and GB/s.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from typing import Any

import torch

from bench.gpu.common import (
    PROMPT_LEN,
    QWEN_VOCAB,
    UNFUSED,
    Report,
    copy_bandwidth,
    flashinfer_missing,
    free,
    kv_bytes_per_token,
    qwen_engine,
    rand_ids,
)
from bench.gpu.kernel_tuning import tune_decode_attention, tune_gemv
from engine import LLM
from engine.models.kernels import set_unfused
from instrumentation.sampling import SamplingParams

# -- per-kernel breakdown of a decode step ---------------------------------------------------
# (class, name substrings), first match wins; names are compared in lower case. Refine them from
# the "unclassified" lines the section prints.
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qk norm + rope + kv store (fused)", ("qkv_epilogue",)),
    ("sampling", ("argmax", "topk", "top_k", "multinomial", "sampling", "softmax", "sort")),
    (
        "attention",
        (
            "prefill",
            "decode",
            "mergestate",
            "merge_state",
            "paged_attention",
            "attention",
            "fmha",
            "flash_fwd",
            "flash_attn",
            "flashattn",
        ),
    ),
    (
        "gemm",
        (
            "gemm",
            "gemv",
            "nvjet",
            "cutlass",
            "xmma",
            "splitkreduce",
            "cublas",
            "matmul",
            "dot_kernel",
        ),
    ),
    ("norm", ("rmsnorm", "layernorm", "norm_kernel", "_norm")),
    ("rope", ("rotary", "rope_", "_rope")),
    ("activation", ("act_and_mul", "silu", "gelu", "swiglu")),
    ("kv store", ("index_copy",)),
    ("embedding", ("embedding", "indexselect", "index_select", "gather")),
    ("copy-memset", ("memcpy", "memset", "copy", "fill", "cat_", "catarray")),
)
KERNEL_CLASS_NAMES = [c for c, _ in KERNEL_CLASSES] + ["other"]


def classify_kernel(name: str) -> str:
    """The class of a CUDA kernel (or memcpy/memset) from its name; "other" when none fits."""
    n = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in n for k in keys):
            return cls
    return "other"


def kernel_breakdown(kernels: list[tuple[str, float]], steps: int, top: int = 15) -> dict[str, Any]:
    """Per-step totals of (kernel name, µs) pairs seen over `steps` steps: per class (kernels,
    µs, share of all kernel time), the `top` names by time, and the unclassified names."""
    steps = max(steps, 1)
    total = sum(us for _, us in kernels) or 1.0
    classes: dict[str, dict[str, float]] = {
        c: {"kernels": 0.0, "us": 0.0, "share": 0.0} for c in KERNEL_CLASS_NAMES
    }
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        c = classes[classify_kernel(name)]
        c["kernels"] += 1 / steps
        c["us"] += us / steps
        acc = by_name.setdefault(name, [0.0, 0.0])
        acc[0] += 1 / steps
        acc[1] += us / steps
    for c in classes.values():
        c["share"] = c["us"] * steps / total
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "us_per_step": total / steps if kernels else 0.0,
        "classes": classes,
        "top": [
            {
                "name": n,
                "class": classify_kernel(n),
                "calls": c,
                "us": us,
                "share": us * steps / total,
            }
            for n, (c, us) in ranked[:top]
        ],
        "unclassified": [
            {"name": n, "calls": c, "us": us}
            for n, (c, us) in ranked
            if classify_kernel(n) == "other"
        ][:10],
    }


def device_kernels(prof: Any) -> list[tuple[str, float]]:
    """(name, µs) of every device-side event (kernels, memcpy, memset) a torch profiler saw."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            out.append((str(getattr(e, "trace_name", None) or e.name), e.time_range.elapsed_us()))
    return out


def profile_decode(
    llm: LLM, bs: int, steps: int = 20, warm: int = 5, timed: int = 8
) -> tuple[list[tuple[str, float]], int, float, int]:
    """Profile `steps` decode steps at batch `bs` after `warm` + `timed` unprofiled ones (prompts of
    PROMPT_LEN tokens; the engine must run without overlap, so a step ends with its tokens).
    Returns the device events, the decode steps profiled, the median unprofiled step in ms, and
    the mean context (cached tokens) of the profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(100 + bs)
    params = SamplingParams(max_tokens=warm + timed + steps + 8, ignore_eos=True)
    uids = [llm.submit(rand_ids(PROMPT_LEN, rng, QWEN_VOCAB), params) for _ in range(bs)]

    def is_decode(rec: Any) -> bool:
        return rec is not None and rec.phase == "decode" and len(rec.items) == bs

    seen, guard = 0, 0
    while seen < warm and guard < 200:
        seen += is_decode(llm.step())
        guard += 1
    times = []
    for _ in range(timed):
        t = time.perf_counter()
        rec = llm.step()
        torch.cuda.synchronize()
        if is_decode(rec):
            times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    n = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            n += is_decode(llm.step())
        torch.cuda.synchronize()
    for uid in uids:
        with contextlib.suppress(Exception):
            llm.abort(uid)
    while llm.has_work():
        llm.step()
    ctx = PROMPT_LEN + warm + timed + steps // 2
    step_ms = statistics.median(times) * 1e3 if times else float("nan")
    return device_kernels(prof), n, step_ms, ctx


def run(r: Report, args: argparse.Namespace) -> None:
    tune_gemv(r)
    if (missing := flashinfer_missing()) is None:
        tune_decode_attention(r)
    else:
        r.say(f"(decode attention against FlashInfer's: not run, {missing})")
    breakdown(r)


def breakdown(r: Report) -> None:
    """Per-kernel breakdown of one decode step (Qwen3-0.6B shape, random bf16 weights, 512-token
    prompts, page 16) at batch 1 and 64, through the CUDA graphs."""
    bw = copy_bandwidth(r)
    page16: dict[str, Any] = dict(
        max_running_req=64,
        max_seq_len=1024,
        num_pages=64 * 1024 // 16,
        page_size=16,
        max_extend_tokens=16384,
        cache_type="naive",
        overlap=False,  # a step ends with its tokens: clean step boundaries for the profiler
    )
    raw: dict[str, Any] = {}
    # PDL lets a kernel start while the one before it ends, so profiled kernel spans overlap
    # (a kernel's span includes its wait): the clean per-kernel times are those without it
    modes = (
        ("CUDA graphs, before (unfused)", UNFUSED),
        ("CUDA graphs, after, without PDL", ("pdl",)),
        ("CUDA graphs, after", ()),
    )
    for mode, unfused in modes:
        if r.left() < 30:
            r.say(f"(skipped kernels {mode}: past the deadline)")
            continue
        set_unfused(unfused)
        llm = qwen_engine(**page16, cuda_graph=True)
        gemm_bytes = sum(
            p.numel() * p.element_size() for p in llm.model.parameters() if p.dim() == 2
        )
        kvtok = kv_bytes_per_token(llm)
        for bs in (1, 64):
            kernels, n, step_ms, ctx = profile_decode(llm, bs)
            b = kernel_breakdown(kernels, n)
            b.update(step_ms=step_ms, ctx=ctx, gemm_bytes=gemm_bytes, kv_bytes=bs * ctx * kvtok)
            raw[f"{mode} bs{bs}"] = b
            _kernel_tables(r, mode, bs, b, bw)
        del llm
        free()
        set_unfused(())
    r.data["kernels"] = raw
    before, after = raw.get(f"{modes[0][0]} bs1"), raw.get(f"{modes[1][0]} bs1")  # no PDL
    if before and after:
        r.say(
            f"Batch 1: {before['kernels_per_step']:.0f} kernels and {before['us_per_step']:.0f} "
            f"µs a step before, {after['kernels_per_step']:.0f} and {after['us_per_step']:.0f} "
            "after."
        )
    r.say(
        "Profiled with torch.profiler (CUDA activity only) over 20 decode steps after 13 warm "
        "ones, without overlap (each step waits for its tokens). µs per step: summed kernel "
        "time, so idle gaps between kernels are not in it; share: of that sum. gemm bytes: every "
        "2-D weight once (the tied embedding as the LM head); attention bytes: batch x mean "
        "context x K and V per token."
    )


def _kernel_tables(r: Report, mode: str, bs: int, b: dict[str, Any], bw: float | None) -> None:
    rows = []
    for cls in KERNEL_CLASS_NAMES:
        c = b["classes"][cls]
        if c["kernels"] == 0:
            continue
        nbytes = {"gemm": b["gemm_bytes"], "attention": b["kv_bytes"]}.get(cls)
        gbs = nbytes / (c["us"] * 1e-6) / 1e9 if nbytes and c["us"] else None
        rows.append(
            [
                cls,
                c["kernels"],
                c["us"],
                f"{c['share'] * 100:.1f}%",
                "" if nbytes is None else f"{nbytes / 1e6:,.1f} MB",
                "" if gbs is None else f"{gbs:,.0f}",
                "" if gbs is None or not bw else f"{gbs * 1e9 / bw * 100:.0f}%",
            ]
        )
    rows.append(["all", b["kernels_per_step"], b["us_per_step"], "100%", "", "", ""])
    r.table(
        f"Decode step kernels, {mode}, batch {bs} (Qwen3-0.6B shape, context ~{b['ctx']}; "
        f"unprofiled step {b['step_ms']:.2f} ms, {b['steps']} steps profiled)",
        [
            "class",
            "kernels / step",
            "µs / step",
            "share",
            "bytes read / step",
            "GB/s",
            "of copy bw",
        ],
        rows,
    )
    r.table(
        f"Top kernels, {mode}, batch {bs}",
        ["kernel", "class", "calls / step", "µs / step", "share"],
        [
            [t["name"][:110], t["class"], t["calls"], t["us"], f"{t['share'] * 100:.1f}%"]
            for t in b["top"]
        ],
    )
    if b["unclassified"]:
        r.say(
            "Unclassified: "
            + "; ".join(
                f"`{u['name'][:90]}` ({u['calls']:.1f}/step, {u['us']:.1f} µs)"
                for u in b["unclassified"]
            )
        )
