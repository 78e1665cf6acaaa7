"""overhead: the bench's steps with a JSON hook, and with the WebSocket server and one client."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from instrumentation.sampling import SamplingParams
from scripts.gpu_check.common import (
    NEW_TOKENS,
    OVERHEAD_ROUNDS,
    PROMPT_LEN,
    bench_engine,
    decode_times,
    drive,
    rand_ids,
)
from scripts.gpu_check.report import Report, Switch

CLIENT = r"""
import sys
from websockets.sync.client import connect
n = 0
with connect(sys.argv[1], max_size=None, open_timeout=10) as ws:
    print("connected", flush=True)
    try:
        for _ in ws:
            n += 1
    except Exception:
        pass
print(n, flush=True)
"""


def sec_overhead(r: Report) -> None:
    from engine.server import build, build_parser

    llm = bench_engine(r)
    bs = 64
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    rng = random.Random(64)
    results: dict[str, list[tuple[float, float]]] = {}  # (median, mean) step ms of each run

    def measure(mode: str, step: Callable[[], Any] | None = None) -> None:
        run = drive(llm, [rand_ids(PROMPT_LEN, rng) for _ in range(bs)], params, step)
        times = decode_times(run, bs)
        stats = (statistics.median(times) * 1e3, statistics.fmean(times) * 1e3)
        results.setdefault(mode, []).append(stats)

    measure("warm-up (discarded)")
    switch = Switch()
    switch.target = None

    def hooked(on: bool) -> None:
        """The bare engine has no hook at all; the served one has the server's (its event
        hook behind the switch, and the flush it runs while the engine waits for the device)."""
        for hooks, fn in ((llm.hooks.event, switch), (llm.hooks.wait, loop.flush)):
            if on and fn not in hooks:
                hooks.append(fn)
            elif not on and fn in hooks:
                hooks.remove(fn)

    # the server's own wiring (recorder, publisher, engine loop, command handler); its event
    # hook goes behind the switch instead of being attached for good
    server = build(llm, build_parser().parse_args(["--port", "0"]))
    publisher, loop = server.publisher, server.loop
    publisher.start()
    env = dict(os.environ)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, publisher.url], stdout=subprocess.PIPE, text=True, env=env
    )
    assert client.stdout is not None
    first = client.stdout.readline().strip()
    for _ in range(100):
        if publisher.clients:
            break
        time.sleep(0.05)
    sent0 = publisher.messages_published
    bare, served = "bare engine", "server + 1 client"
    try:
        for k in range(OVERHEAD_ROUNDS):
            # ABBA order, so a drift of the machine's speed over time cancels out
            for mode in (bare, served) if k % 2 == 0 else (served, bare):
                switch.target = loop.on_event if mode == served else None
                hooked(mode == served)
                measure(mode, loop.run_once if mode == served else None)
            switch.target = None
        hooked(False)
        llm.add_event_hook(switch)  # for the stall section, which shares the switch
    finally:
        publisher.stop()
        out, _ = client.communicate(timeout=30)
    received = int(out.strip().splitlines()[-1]) if out.strip() else -1

    def summary(v: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(m for m, _ in v), statistics.fmean(x for _, x in v)

    base_med, base_mean = summary(results[bare])
    rows = []
    for mode in (bare, served):
        med, mean = summary(results[mode])
        runs = ", ".join(f"{m:.3f}" for m, _ in results[mode])
        rows.append(
            [mode, med, mean, runs, (med / base_med - 1) * 100, (mean / base_mean - 1) * 100]
        )
    ratios = [b[0] / a[0] for a, b in zip(results[bare], results[served], strict=True)]
    r.say(
        "Per round, server / bare median step: "
        + ", ".join(f"{(x - 1) * 100:+.1f}%" for x in ratios)
        + f"; median of rounds {(statistics.median(ratios) - 1) * 100:+.2f}%."
    )
    r.data["overhead"] = {
        "results_ms": results,
        "server_over_bare": ratios,
        "client": first,
        "published": publisher.messages_published - sent0,
        "received": received,
    }
    r.table(
        f"Instrumentation overhead: decode steps at batch {bs}, {OVERHEAD_ROUNDS} interleaved "
        "rounds",
        [
            "mode",
            "median step ms",
            "mean step ms",
            "median of each run",
            "median vs bare (%)",
            "mean vs bare (%)",
        ],
        rows,
    )
    r.say(
        f"Server run: messages published {publisher.messages_published - sent0}, received by the "
        f"client (another process) {received} (hello included)."
    )
    r.switch = switch
