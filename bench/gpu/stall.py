"""stall: an 8,000-token prompt arriving among 32 decoding requests, both policies at budgets
128 to 8,192: the prompt's TTFT, and the decoders' token gaps while it is prefilled against
their steady gap before it arrived."""

from __future__ import annotations

import argparse
import contextlib
import random
from typing import Any

from bench.gpu.common import Report, free, qwen_engine, rand_ids
from instrumentation.metrics import gaps, percentile
from instrumentation.protocol import POLICY_NAMES
from instrumentation.records import TokenEvent
from instrumentation.sampling import SamplingParams

LONG, DECODERS = 8000, 32
BUDGETS = (128, 512, 2048, 8192)
HEADERS = ["policy", "budget", "long prompt TTFT ms", "steady ITL ms", "ITL p50 ms",
           "ITL p99 ms", "ITL max ms", "max / steady", "output tok/s",
           "tok/s with the prompt's"]  # fmt: skip


def run(r: Report, args: argparse.Namespace) -> None:
    llm = qwen_engine(max_running_req=DECODERS + 8, max_seq_len=LONG + 64, cache_type="naive",
                      page_size=16, num_pages=(DECODERS * 1200 + LONG + 64) // 16 + 64)  # fmt: skip
    times: dict[int, list[float]] = {}

    def hook(ev: Any) -> None:
        if isinstance(ev, TokenEvent) and ev.uid in times:
            times[ev.uid].append(ev.t)

    llm.add_event_hook(hook)
    llm.generate([rand_ids(64, random.Random(0))], SamplingParams(max_tokens=2, ignore_eos=True))
    rng = random.Random(11)
    rows, raw = [], []
    for budget in BUDGETS:
        for policy in POLICY_NAMES:
            if r.left() < 20:
                r.say(f"(skipped stall {policy} {budget}: past the deadline)")
                continue
            llm.set_config(max_extend_tokens=budget, policy=policy)
            times.clear()
            dec = [llm.submit(rand_ids(128, rng), SamplingParams(max_tokens=1024, ignore_eos=True))
                   for _ in range(DECODERS)]  # fmt: skip
            for uid in dec:
                times[uid] = []
            while min(len(times[u]) for u in dec) < 20:  # decoding steadily
                llm.step()
            steady = [g for u in dec for g in gaps(times[u][4:])]
            t_sub = llm.now()
            long = llm.submit(rand_ids(LONG, rng), SamplingParams(max_tokens=8, ignore_eos=True))
            times[long] = []
            while not times[long]:
                llm.step()
            for _ in range(16):  # and a little past its first token
                llm.step()
            t_end, first = llm.now(), times[long][0]
            window = [b - a for u in dec for a, b in zip(times[u], times[u][1:], strict=False)
                      if t_sub < b <= t_end]  # fmt: skip
            n_out = sum(1 for u in dec for t in times[u] if t_sub < t <= t_end)
            span = t_end - t_sub
            row = {
                "policy": policy, "budget": budget, "ttft_ms": (first - t_sub) * 1e3,
                "steady_ms": (percentile(steady, 50) or 0.0) * 1e3,
                "itl_p50_ms": (percentile(window, 50) or 0.0) * 1e3,
                "itl_p99_ms": (percentile(window, 99) or 0.0) * 1e3,
                "itl_max_ms": max(window, default=0.0) * 1e3,
            }  # fmt: skip
            row["max_over_steady"] = row["itl_max_ms"] / row["steady_ms"] if steady else None
            row["out_tok_s"] = n_out / span
            row["tok_s_with_prompt"] = (n_out + LONG) / span
            raw.append(row)
            rows.append(list(row.values()))
            print(row, flush=True)
            for uid in [*dec, long]:
                with contextlib.suppress(Exception):
                    llm.abort(uid)
            while llm.has_work():
                llm.step()
    r.data["stall"] = raw
    r.table(
        f"A {LONG:,}-token prompt arrives among {DECODERS} decoding requests (Qwen3-0.6B shape)",
        HEADERS,
        rows,
    )
    r.say(
        "Steady ITL: the decoders' median gap before the prompt arrived. The window runs from "
        "the prompt's submission to 16 steps after its first token; ITL: the decoders' gaps "
        "ending in it; output tok/s: their tokens in the window over its length."
    )
    del llm
    free()
