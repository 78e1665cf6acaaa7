"""What one live update of the page's charts costs: the feed's Python work and bytes per update,
and (with --browser) the main-thread time of drawing it in Chromium.

    python scripts/bench_figures.py                        # 64 requests, 5 new steps per update
    python scripts/bench_figures.py --requests 64 --browser

With `window` steps already in the browser, one update is the store's delta for the steps that
arrived since the last (`--batch`, about a quarter second of engine steps), encoded by the feed
(app/live): its Python time and its bytes. `--browser` also replays those updates in Debian's
chromium and reports the main-thread time per update (the `stepscope-update` measure of
app/live/static/view.js) next to the same browser's floor, one Plotly.react of a 1,000-point line.

The classic Python figures this script measured before are gone (issue 24); their last
measurement is in docs/benchmarks.md. Whether the page keeps up with a real engine is
scripts/bench_live_page.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.state import EventStore  # noqa: E402


def busy_trace(num_steps: int, requests: int) -> list[dict]:
    """`requests` long greedy requests decoding together (a new one for each that ends)."""
    from tests.app.app_peer import SimEngine

    sim = SimEngine(max_extend_tokens=256, policy="mixed", num_pages=1_000_000)
    out: list[dict] = [_hello(sim)]
    for k in range(requests):
        out += sim.submit(prompt_len=16 + k % 24, max_tokens=400 + 37 * k)[1]
    steps = 0
    while steps < num_steps:
        msgs = sim.step()
        out += msgs
        steps += 1
        ended = sum(1 for m in msgs if m.get("event") == "finished")
        for _ in range(ended):
            out += sim.submit(prompt_len=24, max_tokens=500)[1]
    return out


def _hello(sim: object) -> dict:
    return {
        "type": "hello",
        "protocol": 1,
        "now": 0.0,
        "engine": {"model": "sim", "page_size": 1, "num_pages": 1_000_000},
        "config": dict(sim.config),  # type: ignore[attr-defined]
        "history": {"steps": [], "requests": []},
    }


def live_updates(
    messages: list[dict], window: int, batch: int
) -> tuple[list[dict], list[float], list[int]]:
    """Payloads of a browser that holds `window` steps and pulls every `batch` new steps; with
    the feed's Python time and the JSON bytes of each (the first one is the reset)."""
    import json

    from app.live.feed import LiveFeed, ViewOptions

    store, feed = EventStore(), LiveFeed()
    opts = ViewOptions(window=window, xmode="step")
    payloads, times, sizes = [], [], []
    have, steps, due = None, 0, window
    for msg in messages:
        store.apply(msg)
        steps += msg.get("type") == "step"
        if steps < due or msg.get("type") != "step":
            continue
        t0 = time.perf_counter()
        data = feed.payload(store, have, opts)
        times.append(time.perf_counter() - t0)
        sizes.append(len(json.dumps(data, separators=(",", ":"))))
        payloads.append(data)
        have, due = data["id"], steps + batch
    return payloads, times, sizes


BROWSER_JS = """([payloads, style]) => {
    const el = document.getElementById('root');
    const send = (p) => window.stepscopeLive.render(
        {parentElement: el, setStateValue: () => {}, data: Object.assign({style}, p)});
    for (const p of payloads) send(p);
    const ms = performance.getEntriesByName('stepscope-update').slice(1).map(e => e.duration);
    ms.sort((a, b) => a - b);
    return {median: ms[ms.length >> 1], p90: ms[Math.floor(0.9 * (ms.length - 1))],
            updates: ms.length, lod: document.querySelector('.stepscope-live').dataset.lod};
}"""


def browser_updates(payloads: list[dict]) -> dict:
    """Replay the payloads in chromium (no server): main-thread ms per live update."""
    import tempfile

    import plotly
    from playwright.sync_api import sync_playwright

    from app.live.component import SCRIPTS, STATIC, style
    from tests.app.browser_floor import FLOOR_JS

    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    scripts = "".join(f"<script src='{(STATIC / name).as_uri()}'></script>" for name in SCRIPTS)
    html = (
        "<html><head><meta charset='utf-8'></head><body><div id='root' style='width:1400px'>"
        f"</div><script src='{plotly_js.as_uri()}'></script>{scripts}</body></html>"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".html", delete=False) as f:
        f.write(html)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=args)
        page = browser.new_page(viewport={"width": 1600, "height": 1300})
        page.goto(Path(f.name).as_uri())
        page.wait_for_function("() => window.stepscopeLive && window.Plotly")
        out = page.evaluate(BROWSER_JS, [payloads, style()])
        out["floor"] = page.evaluate(FLOOR_JS)
        browser.close()
    return out


def live_main(args: argparse.Namespace) -> int:
    messages = busy_trace(max(args.windows) + 40 * args.batch, args.requests)
    print(f"live updates: {args.requests} requests, {args.batch} new steps per update")
    header = f"{'steps in view':>13} {'python ms/update':>16} {'KB/update':>10} {'reset KB':>9}" + (
        f" {'browser ms median':>17} {'p90':>6} {'floor':>6} {'detail':>8}" if args.browser else ""
    )
    print(header)
    print("-" * len(header))
    for window in args.windows:
        payloads, times, sizes = live_updates(messages, window, args.batch)
        line = (
            f"{window:>13} {statistics.median(times[1:]) * 1e3:>16.2f} "
            f"{statistics.median(sizes[1:]) / 1024:>10.1f} {sizes[0] / 1024:>9.0f}"
        )
        if args.browser:
            b = browser_updates(payloads)
            line += f" {b['median']:>17.1f} {b['p90']:>6.1f} {b['floor']:>6.1f} {b['lod']:>8}"
        print(line)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[500, 5_000])
    parser.add_argument("--requests", type=int, default=64, help="requests in flight")
    parser.add_argument("--batch", type=int, default=5, help="new steps per update")
    parser.add_argument("--browser", action="store_true", help="replay the updates in chromium")
    return live_main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
