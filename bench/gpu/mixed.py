"""mixed: a mixed step (64 decodes and a 512-token chunk of a long prompt) against the decode
step alone, with its kernels; and where the host waits for the device during overlapped steps
of every kind."""

from __future__ import annotations

import argparse
import random
import warnings
from pathlib import Path

import torch

from bench.gpu.chunk import chunk_step, profile_table
from bench.gpu.common import Report, free, qwen_engine, rand_ids
from instrumentation.sampling import SamplingParams

DECODERS, CHUNK = 64, 512


def run(r: Report, args: argparse.Namespace) -> None:
    llm = qwen_engine(max_extend_tokens=CHUNK + DECODERS, policy="mixed", max_running_req=96,
                      max_seq_len=8192, cache_type="naive")  # fmt: skip
    step = chunk_step(llm, DECODERS, CHUNK)
    del llm
    free()
    decode, mixed = step["decode_only_ms"], step["period_ms"]
    r.table(
        f"{DECODERS} decodes alone against {DECODERS} decodes + a {CHUNK}-token chunk "
        "(Qwen3-0.6B shape, policy mixed)",
        ["decode step ms", "mixed step ms", "mixed / decode", "chunk ms (the difference)",
         "per chunk token µs", "mixed steps measured"],
        [[decode, mixed, mixed / decode if decode and mixed else None,
          mixed - decode if decode and mixed else None,
          (mixed - decode) / CHUNK * 1e3 if decode and mixed else None, step["steps"]]],
    )  # fmt: skip
    profile_table(r, f"A mixed step ({DECODERS} decodes + {CHUNK}-token chunk)", step)
    r.data["mixed"] = {k: v for k, v in step.items() if k != "profile"} | {
        "top": step["profile"].top
    }
    if r.left() > 30:
        syncs(r)


def syncs(r: Report) -> None:
    """Where the host waits for the device during steps: torch's sync debug mode flags every
    synchronizing call (blocking copies, .item(), ...) made while a workload with prefill, mixed
    and decode steps runs. With overlap, only reading a finished step's tokens should wait."""
    llm = qwen_engine(max_running_req=16, num_pages=4096, policy="mixed", max_extend_tokens=256)
    rng = random.Random(9)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for n in (300, 40, 12):
        llm.submit(rand_ids(n, rng), params)
    for _ in range(3):
        llm.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = 0
            while llm.has_work():
                if steps == 4:
                    llm.submit(rand_ids(700, rng), params)  # mixed steps follow
                llm.step()
                steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    where: dict[str, int] = {}
    for w in caught:
        key = f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:80]}"
        where[key] = where.get(key, 0) + 1
    r.data["syncs"] = {"steps": steps, "where": where}
    r.table(
        f"Synchronizing calls during {steps} overlapped steps (torch sync debug mode)",
        ["call site", "count"],
        [[k, v] for k, v in sorted(where.items(), key=lambda kv: -kv[1])] or [["none", 0]],
    )
    del llm
    free()
