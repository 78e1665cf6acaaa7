"""How long a dashboard redraw takes: every figure built from a long trace, then serialized;
and what one live update costs instead.

    python scripts/bench_figures.py                       # synthetic 5,000-step trace
    python scripts/bench_figures.py --trace run.jsonl     # a trace from engine.server --trace
    python scripts/bench_figures.py --live --requests 64 --browser   # per-update cost

A redraw is what a classic fragment rerun does per chart: build the figure from the recorded
events (app.figures) and serialize it to the JSON that `st.plotly_chart` sends (to_dict +
to_json). Prints the median of --repeat runs per figure and window, and the whole page's sum.

`--live` measures the live charts (app/live) instead: with `window` steps already in the
browser, one update is the store's delta for the steps that arrived since the last (`--batch`,
about a quarter second of engine steps), encoded by the feed: its Python time and its bytes.
`--browser` also replays those updates in Debian's chromium and reports the main-thread time
per update (the `stepscope-update` measure of app/live/static/live.js) next to the same
browser's floor, one Plotly.react of a 1,000-point line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import plotly.graph_objects as go  # noqa: E402
import plotly.io as pio  # noqa: E402

from app import figures  # noqa: E402
from app.derive import headline  # noqa: E402
from app.state import EventStore, Snapshot  # noqa: E402


def load(trace: Path | None, steps: int) -> Snapshot:
    store = EventStore(max_steps=max(steps, 1))
    if trace is None:
        from tests.app.app_peer import synthetic_trace

        messages = synthetic_trace(steps)
    else:
        from instrumentation.trace import read_jsonl

        messages = list(read_jsonl(trace))
    for msg in messages:
        store.apply(msg)
    return store.snapshot()


def builders(snap: Snapshot) -> dict[str, Callable[[list[dict]], go.Figure | object]]:
    reqs = snap.requests
    return {
        "timeline (step x)": lambda s: figures.timeline_figure(s, reqs, x="step"),
        "timeline (time x)": lambda s: figures.timeline_figure(s, reqs, x="time"),
        "KV pool": lambda s: figures.kv_figure(s, page_size=snap.page_size),
        "decode progress": lambda s: figures.decode_progress_figure(s, reqs),
        "inter-token latency": lambda s: figures.itl_figure(s, reqs),
        "headline metrics": lambda s: headline(s, reqs),
    }


def measure(build: Callable[[], object], repeat: int) -> tuple[float, float, int]:
    builds, serials, size = [], [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        fig = build()
        t1 = time.perf_counter()
        if isinstance(fig, go.Figure):
            size = len(pio.to_json(fig.to_dict(), validate=False))
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        serials.append(t2 - t1)
    return statistics.median(builds), statistics.median(serials), size


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

    from app.live.component import STATIC, style
    from tests.app.browser_floor import FLOOR_JS

    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    html = (
        "<html><head><meta charset='utf-8'></head><body><div id='root' style='width:1400px'>"
        f"</div><script src='{plotly_js.as_uri()}'></script>"
        f"<script src='{(STATIC / 'live.js').as_uri()}'></script></body></html>"
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
    parser.add_argument("--trace", type=Path, help="JSON-lines trace (engine.server --trace)")
    parser.add_argument("--steps", type=int, default=5_000, help="synthetic trace length")
    parser.add_argument("--windows", type=int, nargs="+", default=[500, 5_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--live", action="store_true", help="per-update cost of the live charts")
    parser.add_argument("--requests", type=int, default=64, help="--live: requests in flight")
    parser.add_argument("--batch", type=int, default=5, help="--live: new steps per update")
    parser.add_argument("--browser", action="store_true", help="--live: replay in chromium")
    args = parser.parse_args()
    if args.live:
        return live_main(args)

    snap = load(args.trace, args.steps)
    print(f"trace: {len(snap.steps):,} steps, {len(snap.requests):,} requests")
    header = f"{'figure':<22} {'steps':>6} {'build ms':>9} {'serialize ms':>13} {'total ms':>9} {'JSON KB':>8}"
    print(header)
    print("-" * len(header))
    for window in args.windows:
        steps = snap.steps[-window:]
        page = 0.0
        for name, build in builders(snap).items():
            b, s, size = measure(lambda build=build, steps=steps: build(steps), args.repeat)
            page += b + s if "time x" not in name else 0.0  # the page draws one timeline
            print(
                f"{name:<22} {len(steps):>6} {b * 1e3:>9.1f} {s * 1e3:>13.1f} "
                f"{(b + s) * 1e3:>9.1f} {size / 1024:>8.0f}"
            )
        print(f"{'whole page (all tabs)':<22} {len(steps):>6} {'':>9} {'':>13} {page * 1e3:>9.1f}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
