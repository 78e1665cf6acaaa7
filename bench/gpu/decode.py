"""decode: decode steps against the memory floor, the engine's options beside the default, where
the host's time goes, and Hugging Face generate at the same shapes."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.gpu.common import (
    NEW_TOKENS,
    PROMPT_LEN,
    Report,
    copy_bandwidth,
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
from engine import LLM
from instrumentation.sampling import SamplingParams

LONG_CONTEXT = 4096  # the long-context row's prompts (batch 16)
PAGE16: dict[str, Any] = dict(
    max_running_req=256,
    max_seq_len=1024,
    num_pages=256 * 680 // 16,
    page_size=16,
    max_extend_tokens=16384,
    cache_type="naive",
)
HEADERS = ["variant", "batch", "step ms (mean)", "step ms (median)", "launch ms (host)",
           "graph replay ms", "memory floor ms", "step / floor", "decode tok/s",
           "end-to-end tok/s"]  # fmt: skip


def variants(batches: tuple[int, ...]) -> list[tuple[str, Callable[[], LLM], tuple[int, ...], int]]:
    """(name, engine, batches, prompt length): the default, then one option changed at a time."""
    long16 = {**PAGE16, "max_seq_len": LONG_CONTEXT + NEW_TOKENS + 64}
    two = tuple(b for b in batches if b in (1, 64)) or batches[:1]
    return [
        ("default (page 16, graphs, overlap)", lambda: qwen_engine(**PAGE16), batches, PROMPT_LEN),
        (f"context {LONG_CONTEXT:,}", lambda: qwen_engine(**long16), (16,), LONG_CONTEXT),
        ("no overlap", lambda: qwen_engine(**{**PAGE16, "overlap": False}), two, PROMPT_LEN),
        ("float32 residual", lambda: qwen_engine(**{**PAGE16, "residual_dtype": "float32"}),
         two, PROMPT_LEN),
        ("batch-invariant + float32 residual (Triton)",
         lambda: qwen_engine(**{**PAGE16, "batch_invariant": True, "residual_dtype": "float32"}),
         two, PROMPT_LEN),
    ]  # fmt: skip


def run(r: Report, args: argparse.Namespace) -> None:
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    bw = copy_bandwidth(r)
    rows, raw = [], {}
    wbytes = kvtok = 0
    for name, make, bss, prompt_len in variants(batches):
        if r.left() < 60:
            r.say(f"(skipped decode variant {name}: past the deadline)")
            continue
        llm = make()
        warm = [rand_ids(prompt_len, random.Random(0))]  # the graphs' first replays, not timed
        llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True))
        runner_times = timed_launch(llm)
        wbytes, kvtok = weight_bytes(llm), kv_bytes_per_token(llm)
        for bs in bss:
            runner_times.clear()
            prompts = [rand_ids(prompt_len, random.Random(bs)) for _ in range(bs)]
            run_ = drive(llm, prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
            dec = decode_times(run_, bs)
            mean = statistics.fmean(dec)
            ctx = prompt_len + NEW_TOKENS / 2  # mean context of a decode step
            floor = (wbytes + bs * ctx * kvtok) / bw * 1e3
            row = {
                "variant": name, "batch": bs, "step_ms_mean": mean * 1e3,
                "step_ms_median": statistics.median(dec) * 1e3,
                # the decode steps' launches: the last len(dec) calls
                "launch_ms_median": statistics.median(runner_times[-len(dec):]) * 1e3,
                "replay_ms": replay_ms(llm, bs) if llm.runner.graphs is not None else None,
                "floor_ms": floor, "x_floor": mean * 1e3 / floor, "decode_tok_s": bs / mean,
                "e2e_tok_s": bs * NEW_TOKENS / run_["total_s"],
            }  # fmt: skip
            raw[f"{name} bs{bs}"] = row
            rows.append(list(row.values()))
            print(row, flush=True)
        if name.startswith("default") and r.left() > 90:
            host_profile(r, llm)
        del llm.runner.launch  # back to the class's method
        del llm
        free()
    r.data["decode"] = raw
    r.table(
        f"Engine decode, Qwen3-0.6B shape (random bf16 weights), {PROMPT_LEN}-token prompts "
        f"({LONG_CONTEXT:,} where named), {NEW_TOKENS} new tokens",
        HEADERS,
        rows,
    )
    r.say(
        f"Weights {wbytes / 1e9:.2f} GB read once per step; KV {kvtok / 1e3:.0f} KB per cached "
        f"token; floor = (weights + batch x mean context x KV per token) / {bw / 1e12:.2f} TB/s "
        "(the copy rate measured in this run). Step = the whole `LLM.step()` (schedule, launch, "
        "detokenizing, events); with overlap, one call per step in steady state, so its time is "
        "the step period. Launch = host time of `ModelRunner.launch`; replay = GPU time of the "
        "graph alone, at the last context."
    )
    hf_rows(r, None, list(batches))
    static = [int(b) for b in args.hf_static_batches.split(",") if b]
    if static:
        hf_rows(r, "static", static)


def host_profile(r: Report, llm: LLM, batch: int = 64) -> None:
    """Where the engine thread's host time goes in decode steps (cProfile, by own time)."""
    rng = random.Random(3)
    for _ in range(batch):
        llm.submit(rand_ids(PROMPT_LEN, rng), SamplingParams(max_tokens=48, ignore_eos=True))
    while llm.num_waiting():  # through the prefill
        llm.step()
    prof = cProfile.Profile()
    prof.enable()
    n = 0
    while llm.has_work():
        llm.step()
        n += 1
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
    text = buf.getvalue().strip().split("\n\n", 1)[-1]  # the table, without the preamble
    r.say(
        f"\n### Host profile of {n} decode steps at batch {batch} (own time)\n\n```\n{text}\n```\n"
    )


def hf_rows(r: Report, cache: str | None, batches: list[int]) -> None:
    """Hugging Face `generate` with its default cache (None) or the static one, which compiles
    on its first call: that call is timed apart and the second one measured."""
    from bench.gpu.hf import hf_generate, random_qwen

    model = random_qwen()
    kw = {} if cache is None else {"cache_implementation": cache}
    rows, raw = [], {}
    for bs in batches:
        if r.left() < (40 if cache is None else 150):
            r.say(f"(skipped HF {cache or 'default'} cache at batch {bs}: past the deadline)")
            continue
        label = "default (dynamic)"
        if cache is not None:
            t = time.perf_counter()
            hf_generate(model, bs, **kw)
            label = f"{cache} (first call {time.perf_counter() - t:.0f} s)"
        res = hf_generate(model, bs, **kw)
        raw[bs] = res
        rows.append([label, bs, res["step_ms_mean"], res["step_ms_median"], res["decode_tok_s"],
                     res["e2e_tok_s"]])  # fmt: skip
    r.data["hf" if cache is None else f"hf_{cache}"] = raw
    r.table(
        f"Hugging Face generate, {cache or 'default'} cache, the same shapes (bf16, sdpa)",
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
    del model
    free()
