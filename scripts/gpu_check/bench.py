"""bench: engine decode steps at batch 1/16/64/256 (512-token prompts, 128 new tokens)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

from engine import LLM
from engine.models.kernels import set_unfused
from instrumentation.sampling import SamplingParams
from scripts.gpu_check.common import (
    BATCHES,
    LONG_CONTEXT,
    NEW_TOKENS,
    PROMPT_LEN,
    UNFUSED,
    decode_times,
    drive,
    free,
    kv_bytes_per_token,
    qwen_engine,
    rand_ids,
    replay_ms,
    timed_launch,
    weight_bytes,
)
from scripts.gpu_check.report import Report


def sec_bench(r: Report) -> None:
    bw = r.data.get("copy_bw") or 4.1e12
    rows, raw = [], {}
    page16: dict[str, Any] = dict(
        max_running_req=256,
        max_seq_len=1024,
        num_pages=256 * 680 // 16,
        page_size=16,
        max_extend_tokens=16384,
        cache_type="naive",
    )
    long16 = {**page16, "max_seq_len": LONG_CONTEXT + NEW_TOKENS + 64}

    def tensor_core_decode() -> LLM:
        from engine.attention.flashinfer_backend import FlashInferAttention

        FlashInferAttention.decode_tensor_cores = True
        FlashInferAttention.graph_decode_kernel = False  # FlashInfer's decode in the graphs too
        try:
            return qwen_engine(**page16)
        finally:
            FlashInferAttention.decode_tensor_cores = None
            FlashInferAttention.graph_decode_kernel = None

    # (name, engine, batches, prompt length, decode kernels turned off)
    Variant = tuple[str, Callable[[], LLM], tuple[int, ...], int, tuple[str, ...]]
    variants: list[Variant] = [
        ("page 16, graphs, overlap", lambda: qwen_engine(**page16), BATCHES, PROMPT_LEN, ()),
        (
            "page 16, graphs, overlap, before (unfused decode kernels)",
            lambda: qwen_engine(**page16),
            (1, 64),
            PROMPT_LEN,
            UNFUSED,
        ),
        (
            "page 16, graphs, overlap, FlashInfer decode attention (CUDA cores) in the graphs",
            lambda: qwen_engine(**page16),
            (1, 64),
            PROMPT_LEN,
            ("decode",),
        ),
        (
            "page 16, graphs, overlap, no programmatic dependent launch",
            lambda: qwen_engine(**page16),
            (1, 64),
            PROMPT_LEN,
            ("pdl",),
        ),
        (
            "page 16, graphs, overlap, norms not folded into the GEMVs",
            lambda: qwen_engine(**page16),
            (1,),
            PROMPT_LEN,
            ("fold",),
        ),
        (
            f"page 16, graphs, overlap, context {LONG_CONTEXT:,}",
            lambda: qwen_engine(**long16),
            (16,),
            LONG_CONTEXT,
            (),
        ),
        (
            "page 16, graphs, overlap, tensor-core decode attention",
            tensor_core_decode,
            (1, 64),
            PROMPT_LEN,
            (),
        ),
        (
            "page 16, graphs, no overlap",
            lambda: qwen_engine(**{**page16, "overlap": False}),
            (1, 64),
            PROMPT_LEN,
            (),
        ),
        (
            "page 1, graphs, overlap",
            lambda: qwen_engine(**{**page16, "page_size": 1, "num_pages": 256 * 680}),
            (64,),
            PROMPT_LEN,
            (),
        ),
        (
            "page 16, graphs, overlap, float32 residual",
            lambda: qwen_engine(**{**page16, "residual_dtype": "float32"}),
            (1, 64),
            PROMPT_LEN,
            (),
        ),
        (
            "batch-invariant + float32 residual (Triton), page 16, graphs, overlap",
            lambda: qwen_engine(**{**page16, "batch_invariant": True, "residual_dtype": "float32"}),
            (1, 64),
            PROMPT_LEN,
            (),
        ),
    ]
    if r.bench_quick:  # this round's rows: the default path, before/after, long context
        variants = [v for v in variants if "no overlap" not in v[0] and "residual" not in v[0]]
        variants = [v for v in variants if not v[0].startswith("page 1,")]
        variants = [v for v in variants if "tensor-core" not in v[0]]  # measured in call P
    for name, make, batches, prompt_len, unfused in variants:
        if r.left() < 60:
            r.say(f"(skipped bench variant {name}: out of time)")
            continue
        set_unfused(unfused)
        llm = make()
        runner_times = timed_launch(llm)
        wbytes, kvtok = weight_bytes(llm), kv_bytes_per_token(llm)
        for bs in batches:
            rng = random.Random(bs)
            runner_times.clear()
            run = drive(
                llm,
                [rand_ids(prompt_len, rng) for _ in range(bs)],
                SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
            )
            dec = decode_times(run, bs)
            mean = statistics.fmean(dec)
            # runner.launch of the decode steps: the last len(dec) calls
            run_ms = statistics.median(runner_times[-len(dec) :]) * 1e3
            ctx = prompt_len + NEW_TOKENS / 2  # mean context of a decode step
            floor = (wbytes + bs * ctx * kvtok) / bw * 1e3
            gpu = replay_ms(llm, bs) if llm.runner.graphs is not None else float("nan")
            floor_end = (wbytes + bs * (prompt_len + NEW_TOKENS - 1) * kvtok) / bw * 1e3
            row = {
                "variant": name,
                "batch": bs,
                "step_ms_median": statistics.median(dec) * 1e3,
                "step_ms_mean": mean * 1e3,
                "runner_ms_median": run_ms,
                "decode_tok_s": bs / mean,
                "e2e_tok_s": bs * NEW_TOKENS / run["total_s"],
                "floor_ms": floor,
                "x_floor": mean * 1e3 / floor,
                "replay_ms_ctx639": gpu,
                "floor_ms_ctx639": floor_end,
                "decode_steps": len(dec),
            }
            raw[f"{name} bs{bs}"] = row
            rows.append(
                [
                    name,
                    bs,
                    row["step_ms_mean"],
                    row["step_ms_median"],
                    run_ms,
                    gpu,
                    floor,
                    row["x_floor"],
                    row["decode_tok_s"],
                    row["e2e_tok_s"],
                ]
            )
            print(row, flush=True)
        del llm.runner.launch  # back to the class's method
        r.data["bench_meta"] = {"weight_bytes": wbytes, "kv_bytes_per_token": kvtok, "copy_bw": bw}
        del llm
        free()
        set_unfused(())
    r.data["bench"] = raw
    meta = r.data.get("bench_meta", {})
    wbytes, kvtok = meta.get("weight_bytes", 0), meta.get("kv_bytes_per_token", 0)
    r.table(
        f"Engine decode, Qwen3-0.6B shape (random bf16 weights), {PROMPT_LEN}-token prompts "
        f"({LONG_CONTEXT:,} where named), "
        f"{NEW_TOKENS} new tokens",
        [
            "variant",
            "batch",
            "step ms (mean)",
            "step ms (median)",
            "launch ms (host)",
            "graph replay ms (last context)",
            "memory floor ms (mean context)",
            "step / floor",
            "decode tok/s",
            "end-to-end tok/s",
        ],
        rows,
    )
    r.say(
        f"Weights {wbytes / 1e9:.2f} GB read once per step; KV {kvtok / 1e3:.0f} KB per cached "
        f"token; floor = (weights + batch x context x KV per token) / {bw / 1e12:.2f} TB/s "
        "(the measured copy rate). Step = the whole `LLM.step()` (schedule, launch, detokenizing, "
        "events); with overlap, one call per step in steady state, so its time is the step "
        "period. Launch = host time of `ModelRunner.launch` (inputs, plan, graph launch, "
        "sampling queued); replay = GPU time of the graph alone."
    )
