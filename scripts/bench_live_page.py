"""Does the page keep up with the engine? Updates the live charts draw per second in Chromium,
against the engine's steps per second, measured in the same run.

    python scripts/bench_live_page.py                      # SmolLM2 on CPU, 16 requests
    python scripts/bench_live_page.py --requests 16 --seconds 30 --runs 2

Starts `python -m engine.server --model smollm2 --device cpu` and `streamlit run app/main.py`
on free loopback ports, keeps `--requests` greedy requests decoding (a protocol client submits a
new one for each that finishes), opens the page in Debian's chromium (Playwright), waits until
the charts draw, then counts over `--seconds`:

- the engine's steps per second (the step messages the protocol client receives);
- the page's updates per second: redraws that drew new steps (each change of the charts'
  last step, `data-last`, seen by a MutationObserver; batches that only changed request rows
  are not counted);
- steps per update, the pull round trip (from the browser's pull to Streamlit's answer, the
  `stepscope-pull` measure) and the main-thread time per update (`stepscope-update`).

The target (issue 24): updates/s ≥ min(10, 0.8 × engine steps/s). The ratio is what to compare
across machines: both rates fall together when other processes share the CPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.checks.browser import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    Workload,
    running_app,
    running_engine,
)

LIVE = ".stepscope-live"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@dataclass
class Result:
    engine_steps_per_s: float
    page_updates_per_s: float
    steps_per_update: float
    pull_ms_median: float | None
    update_ms_median: float | None
    decoding: int

    @property
    def ratio(self) -> float:
        return self.page_updates_per_s / max(self.engine_steps_per_s, 1e-9)

    @property
    def target(self) -> float:
        return min(10.0, 0.8 * self.engine_steps_per_s)


def page_state(page: object) -> dict:
    return page.evaluate(  # type: ignore[attr-defined]
        f"() => {{ const r = document.querySelector('{LIVE}'); "
        "return r ? Object.assign({}, r.dataset) : {}; }"
    )


OBSERVE_JS = f"""() => {{
    const r = document.querySelector('{LIVE}');
    window.__drawn = 0; window.__lastSeen = r.dataset.last;
    new MutationObserver(() => {{
        if (r.dataset.last !== window.__lastSeen) {{ window.__lastSeen = r.dataset.last; window.__drawn++; }}
    }}).observe(r, {{attributes: true, attributeFilter: ['data-last']}});
}}"""


def measure(page: object, load: Workload, seconds: float) -> Result:
    page.evaluate(OBSERVE_JS)  # type: ignore[attr-defined]
    s0, last0 = load.steps, int(page_state(page).get("last") or 0)
    t0 = time.monotonic()
    page.wait_for_timeout(seconds * 1000)  # type: ignore[attr-defined]
    t1 = time.monotonic()
    s1, info = load.steps, page_state(page)
    u0, u1 = 0, int(page.evaluate("() => window.__drawn"))  # type: ignore[attr-defined]
    drawn = int(info.get("last") or 0) - last0
    span = t1 - t0
    marks = page.evaluate(  # type: ignore[attr-defined]
        "(n) => ['stepscope-pull', 'stepscope-update'].map(k => "
        "performance.getEntriesByName(k).slice(-n).map(e => e.duration))",
        max(u1 - u0, 1),
    )
    return Result(
        engine_steps_per_s=(s1 - s0) / span,
        page_updates_per_s=(u1 - u0) / span,
        steps_per_update=drawn / max(u1 - u0, 1),
        pull_ms_median=statistics.median(marks[0]) if marks[0] else None,
        update_ms_median=statistics.median(marks[1]) if marks[1] else None,
        decoding=load.decoding,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=400, help="each request's (then replaced)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=1, help="measurements in a row, same processes")
    ap.add_argument("--engine-args", default="", help="extra engine.server flags")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose page to measure")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    from playwright.sync_api import sync_playwright

    flags = ["--max-running-req", str(max(args.requests, 16)), *args.engine_args.split()]
    results: list[Result] = []
    with (
        running_engine(args.model, *flags, root=args.root) as url,
        running_app(url, root=args.root, PYTHONPATH=str(args.root)) as page_url,
        Workload(url, args.requests, args.max_tokens) as load,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1300})
        page.set_default_timeout(180_000)
        page.goto(page_url)
        say(f"engine {url}, page {page_url}")
        # drawing, with every request decoding
        page.wait_for_function(
            f"() => {{ const r = document.querySelector('{LIVE}'); "
            "return r && Number(r.dataset.updates) > 5; }"
        )
        say(f"drawing; {load.steps} engine steps so far")
        waited = 0
        while load.decoding < args.requests and waited < 240:  # at most 2 minutes
            page.wait_for_timeout(500)
            waited += 1
            if waited % 20 == 0:
                say(f"{load.steps} steps, {load.decoding} decoding in the last")
        say(f"{load.decoding} requests decoding")
        page.wait_for_timeout(3000)
        for _ in range(args.runs):
            results.append(measure(page, load, args.seconds))
        browser.close()
    print(f"live page against the engine: {args.model} on CPU, {args.requests} requests decoding,"
          f" {args.seconds:.0f} s per run, {os.cpu_count()} CPUs")  # fmt: skip
    head = (f"{'engine steps/s':>14} {'page updates/s':>14} {'ratio':>6} {'target/s':>8} "
            f"{'steps/update':>12} {'pull ms':>8} {'update ms':>9} {'met':>4}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in results:
        met = "yes" if r.page_updates_per_s >= r.target else "no"
        pull = "–" if r.pull_ms_median is None else f"{r.pull_ms_median:.0f}"
        upd = "–" if r.update_ms_median is None else f"{r.update_ms_median:.1f}"
        print(f"{r.engine_steps_per_s:>14.2f} {r.page_updates_per_s:>14.2f} {r.ratio:>6.2f} "
              f"{r.target:>8.2f} {r.steps_per_update:>12.2f} {pull:>8} {upd:>9} {met:>4}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
