"""syncs: host-device synchronizations per engine step."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from instrumentation.sampling import SamplingParams
from scripts.gpu_check.common import free, qwen_engine, rand_ids
from scripts.gpu_check.report import Report


def sec_syncs(r: Report) -> None:
    """Where the host waits for the device during steps: torch's sync debug mode flags every
    synchronizing call (blocking copies, .item(), ...) made while a workload with prefill, mixed
    and decode steps runs. With overlap, only reading a finished step's tokens should wait."""
    import warnings

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
