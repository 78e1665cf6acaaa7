"""stall: the stall table, an 8,000-token prompt arriving among 32 decoding requests."""

from __future__ import annotations

import contextlib
import random

from instrumentation.records import TokenEvent
from instrumentation.sampling import SamplingParams
from scripts.gpu_check.common import DECODERS, LONG_PROMPT, bench_engine, rand_ids
from scripts.gpu_check.report import Report, Switch


def sec_stall(r: Report) -> None:
    llm = bench_engine(r)
    switch = r.switch
    if switch is None:
        switch = r.switch = Switch()
        llm.add_event_hook(switch)
    events: list[TokenEvent] = []
    switch.target = lambda ev: events.append(ev) if isinstance(ev, TokenEvent) else None
    rows, raw = [], []
    rng = random.Random(11)
    for policy in ("prefill_first", "mixed"):
        for budget in (128, 512, 2048, 8192):
            if r.left() < 20:
                r.say(f"(skipped stall {policy} {budget}: out of time)")
                continue
            events.clear()
            llm.set_config(max_extend_tokens=budget, policy=policy)
            dec = [
                llm.submit(rand_ids(128, rng), SamplingParams(max_tokens=1024, ignore_eos=True))
                for _ in range(DECODERS)
            ]
            counts = dict.fromkeys(dec, 0)
            prev: dict[int, float] = {}  # each decoder's latest token time
            while min(counts.values()) < 2:
                llm.step()
                for ev in events:
                    if ev.uid in counts:
                        counts[ev.uid] += 1
                        prev[ev.uid] = ev.t
                events.clear()
            t_sub = llm.now()
            long = llm.submit(
                rand_ids(LONG_PROMPT, rng), SamplingParams(max_tokens=8, ignore_eos=True)
            )
            first = None
            after = 0
            while after < 16:
                llm.step()
                if first is None:
                    first = next((ev.t for ev in events if ev.uid == long), None)
                else:
                    after += 1
            t_end = llm.now()
            window = [ev for ev in events if ev.t <= t_end]
            itl: list[float] = []  # a decoder's first gap starts at its last token before t_sub
            for ev in window:
                if ev.uid in prev:
                    itl.append(ev.t - prev[ev.uid])
                    prev[ev.uid] = ev.t
            n_out = len(window)
            span = t_end - t_sub
            itl_ms = sorted(x * 1e3 for x in itl)
            row = {
                "policy": policy,
                "budget": budget,
                "ttft_s": (first or float("nan")) - t_sub,
                "itl_p50_ms": _pct(itl_ms, 50),
                "itl_p99_ms": _pct(itl_ms, 99),
                "itl_max_ms": itl_ms[-1],
                "out_tok_s": n_out / span,
                "tok_s_with_prompt": (n_out + LONG_PROMPT) / span,
                "window_s": span,
            }
            raw.append(row)
            rows.append(
                [
                    policy,
                    budget,
                    row["ttft_s"] * 1e3,
                    row["itl_p50_ms"],
                    row["itl_p99_ms"],
                    row["itl_max_ms"],
                    row["out_tok_s"],
                    row["tok_s_with_prompt"],
                ]
            )
            print(row, flush=True)
            for uid in [*dec, long]:
                with contextlib.suppress(Exception):
                    llm.abort(uid)
            while llm.has_work():
                llm.step()
    switch.target = None
    r.data["stall"] = raw
    r.table(
        f"Stall table: a {LONG_PROMPT:,}-token prompt arrives among {DECODERS} decoding requests "
        "(Qwen3-0.6B shape)",
        [
            "policy",
            "budget",
            "TTFT of the long prompt (ms)",
            "ITL p50 (ms)",
            "ITL p99 (ms)",
            "ITL max (ms)",
            "output tok/s",
            "tok/s incl. the prompt's 8,000",
        ],
        rows,
    )
    r.say(
        "Window: from the long prompt's submission until 16 steps after its first token. ITL: gaps "
        "between consecutive tokens of the 32 decoding requests ending in that window. "
        "Output tok/s: tokens sampled in the window over its length."
    )


def _pct(xs: list[float], q: float) -> float:
    from instrumentation.metrics import percentile

    v = percentile(xs, q)
    return float("nan") if v is None else v
