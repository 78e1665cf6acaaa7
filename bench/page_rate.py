"""Does the page keep up with the engine? Updates the live charts draw per second in Chromium,
against the engine's steps per second, measured in the same run; and (`--update-cost`) what one
chart update costs.

    python -m bench.page_rate                           # SmolLM2 on CPU, 16 requests
    python -m bench.page_rate --requests 16 --seconds 30 --runs 2
    python -m bench.page_rate --update-cost [--browser]   # one update's Python, bytes, drawing

Live (the default): starts `python -m engine.server --model MODEL` and `streamlit run
app/main.py` on free loopback ports, keeps `--requests` greedy requests decoding (a protocol
client submits a new one for each that finishes), opens the page in Chromium (Playwright), waits
until the charts draw, then counts over `--seconds`: the engine's steps per second (the step
messages the protocol client receives); the page's updates per second (redraws that drew new
steps: each change of the charts' last step, `data-last`); steps per update, the pull round trip
(the `stepscope-pull` measure) and the main-thread time per update (`stepscope-update`). The
target: updates/s >= min(10, 0.8 x engine steps/s). The ratio is what to compare across
machines: both rates fall together when other processes share the CPU.

`--update-cost`: a recording (`--trace FILE`, any the server's `--trace` wrote; else one made
here: `--requests` requests decoding on a tiny random-weight model, about a minute), then, with `--windows` steps already in the browser, one update is the store's delta for the
`--batch` steps since the last, encoded by the feed (app/live): its Python time and bytes; with
`--browser` those updates are also replayed in Chromium (no server) for the main-thread time per
update, beside the same browser's floor (one Plotly.react of a 1,000-point line).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import model_path, table

ROOT = Path(__file__).resolve().parents[1]
LIVE = ".stepscope-live"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                 "--no-first-run", "--disable-background-networking", "--disable-sync"]  # fmt: skip


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- the processes: an engine, the page, a protocol client -------------------------------------


@contextmanager
def running_engine(model: str, flags: list[str], root: Path) -> Iterator[str]:
    """`python -m engine.server` from the checkout at `root`; yields its WebSocket URL."""
    from app.launcher import EngineProcess

    argv = [sys.executable, "-m", "engine.server", "--port", "0", "--model", model,
            "--http-port", "0", *flags]  # fmt: skip
    proc = EngineProcess(argv, cwd=root).start()
    try:
        while proc.state == "starting":
            time.sleep(0.2)
        if proc.state != "ready" or not proc.ready_url:
            raise SystemExit("the engine did not start:\n" + "\n".join(proc.tail(20)))
        yield proc.ready_url
    finally:
        proc.stop()


@contextmanager
def running_page(engine_url: str, root: Path) -> Iterator[str]:
    """`streamlit run app/main.py` on a free port, watching `engine_url`; yields its URL."""
    with socket.socket() as s:  # a free port for the page
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "STEPSCOPE_URL": engine_url, "STEPSCOPE_AUTOSTART": "0",
           "PYTHONPATH": str(root)}  # fmt: skip
    env.pop("STEPSCOPE_TRACE", None)
    argv = [sys.executable, "-m", "streamlit", "run", "app/main.py", "--server.headless", "true",
            "--server.port", str(port), "--browser.gatherUsageStats", "false"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health") as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the page did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(15)


class Workload:
    """A protocol client that keeps `n` greedy requests in flight (a new one per ended one);
    `steps` counts the engine's steps, `decoding` the decodes of the last one."""

    def __init__(self, url: str, n: int, max_tokens: int, seed: int = 0) -> None:
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.rng = random.Random(seed)
        self.steps = 0
        self.decoding = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Workload:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _submit(self, ws: Any, k: int) -> None:
        ids = [self.rng.randrange(3, 40000) for _ in range(self.rng.randint(8, 40))]
        cmd = {"type": "submit", "id": f"w{k}", "input_ids": ids, "max_tokens": self.max_tokens}
        ws.send(json.dumps(cmd | {"ignore_eos": True}))

    def _run(self) -> None:
        from websockets.sync.client import connect

        with connect(self.url, max_size=2**27) as ws:
            ws.recv()  # hello
            for sent in range(self.n):
                self._submit(ws, sent)
            sent = self.n
            while not self._stop.is_set():
                try:
                    msg = json.loads(ws.recv(timeout=1))
                except TimeoutError:
                    continue
                if msg.get("type") == "step":
                    self.steps += 1
                    self.decoding = sum(1 for i in msg.get("items", ()) if i["kind"] == "decode")
                elif msg.get("type") == "request" and msg.get("event") == "finished":
                    self._submit(ws, sent)
                    sent += 1


# -- live: the page against the engine ---------------------------------------------------------


@dataclass
class Result:
    engine_steps_per_s: float
    page_updates_per_s: float
    steps_per_update: float
    pull_ms_median: float | None
    update_ms_median: float | None

    @property
    def target(self) -> float:
        return min(10.0, 0.8 * self.engine_steps_per_s)


OBSERVE_JS = f"""() => {{
    const r = document.querySelector('{LIVE}');
    window.__drawn = 0; window.__lastSeen = r.dataset.last;
    new MutationObserver(() => {{
        if (r.dataset.last !== window.__lastSeen) {{ window.__lastSeen = r.dataset.last; window.__drawn++; }}
    }}).observe(r, {{attributes: true, attributeFilter: ['data-last']}});
}}"""
STATE_JS = (
    f"() => {{ const r = document.querySelector('{LIVE}'); return r ? {{...r.dataset}} : {{}}; }}"
)


def measure(page: Any, load: Workload, seconds: float) -> Result:
    page.evaluate(OBSERVE_JS)
    s0, last0 = load.steps, int(page.evaluate(STATE_JS).get("last") or 0)
    t0 = time.monotonic()
    page.wait_for_timeout(seconds * 1000)
    span = time.monotonic() - t0
    s1, info = load.steps, page.evaluate(STATE_JS)
    drawn = int(page.evaluate("() => window.__drawn"))
    marks = page.evaluate(
        "(n) => ['stepscope-pull', 'stepscope-update'].map(k => "
        "performance.getEntriesByName(k).slice(-n).map(e => e.duration))",
        max(drawn, 1),
    )
    return Result(
        engine_steps_per_s=(s1 - s0) / span,
        page_updates_per_s=drawn / span,
        steps_per_update=(int(info.get("last") or 0) - last0) / max(drawn, 1),
        pull_ms_median=statistics.median(marks[0]) if marks[0] else None,
        update_ms_median=statistics.median(marks[1]) if marks[1] else None,
    )


def live(args: argparse.Namespace) -> None:
    from playwright.sync_api import sync_playwright

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    flags = ["--device", args.device, "--max-running-req", str(max(args.requests, 16)),
             *args.engine_args.split()]  # fmt: skip
    results: list[Result] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_engine(model_path(args.model, Path(tmp)), flags, args.root) as url,
        running_page(url, args.root) as page_url,
        Workload(url, args.requests, args.max_tokens) as load,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1300})
        page.set_default_timeout(180_000)
        page.goto(page_url)
        say(f"engine {url}, page {page_url}")
        page.wait_for_function(  # drawing, with every request decoding
            f"() => {{ const r = document.querySelector('{LIVE}'); "
            "return r && Number(r.dataset.updates) > 5; }"
        )
        deadline = time.monotonic() + 120
        while load.decoding < args.requests and time.monotonic() < deadline:
            page.wait_for_timeout(500)
        say(f"{load.decoding} requests decoding, {load.steps} engine steps so far")
        page.wait_for_timeout(3000)
        results = [measure(page, load, args.seconds) for _ in range(args.runs)]
        browser.close()
    print(f"\nthe live page against the engine: {args.model} on {args.device}, {args.requests} "
          f"requests decoding, {args.seconds:.0f} s per run, {os.cpu_count()} CPUs\n")  # fmt: skip
    rows = [
        [r.engine_steps_per_s, r.page_updates_per_s,
         r.page_updates_per_s / max(r.engine_steps_per_s, 1e-9), r.target, r.steps_per_update,
         "-" if r.pull_ms_median is None else f"{r.pull_ms_median:.0f}",
         "-" if r.update_ms_median is None else f"{r.update_ms_median:.1f}",
         "yes" if r.page_updates_per_s >= r.target else "no"]
        for r in results
    ]  # fmt: skip
    print(table(["engine steps/s", "page updates/s", "ratio", "target/s", "steps/update",
                 "pull ms", "update ms", "met"], rows))  # fmt: skip


# -- one update's cost ---------------------------------------------------------------------------


def busy_recording(num_steps: int, requests: int) -> list[dict[str, Any]]:
    """A trace of `requests` long greedy requests decoding together on a tiny random-weight
    model (a new one for each that ends): its hello, then every message."""
    from engine.llm import LLM
    from instrumentation.sampling import SamplingParams
    from instrumentation.sweep import RunTrace
    from instrumentation.trace import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model_path("tiny", Path(tmp)), device="cpu", max_running_req=requests,
                  max_extend_tokens=256, policy="mixed", progress=False)  # fmt: skip
        path = Path(tmp) / "busy.jsonl"
        trace = RunTrace(path, llm.info.to_dict(), llm.config_dict(), llm.now())
        ended = [0]

        def hook(ev: Any) -> None:
            msg = ev.to_dict()
            ended[0] += msg.get("type") == "request" and msg.get("event") == "finished"
            trace(msg)

        llm.add_event_hook(hook)
        rng = random.Random(0)

        def submit(n: int, max_tokens: int) -> None:
            ids = [rng.randrange(100, 20000) for _ in range(n)]
            llm.submit(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

        for k in range(requests):
            submit(16 + k % 24, 400 + 37 * k)
        for _ in range(num_steps):
            llm.step()
            for _ in range(ended[0]):
                submit(24, 500)
            ended[0] = 0
        trace.close()
        return list(read_jsonl(path))


def live_updates(
    messages: list[dict[str, Any]], window: int, batch: int
) -> tuple[list[dict[str, Any]], list[float], list[int]]:
    """Payloads of a browser that holds `window` steps and pulls every `batch` new steps, with
    the feed's Python time and the JSON bytes of each (the first one is the reset)."""
    from app.live.feed import LiveFeed, ViewOptions
    from app.state import EventStore

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
# the same browser's floor: one Plotly.react of a 1,000-point line, median of 20
FLOOR_JS = """() => {
    const gd = document.createElement('div');
    gd.style.width = '1400px';
    document.body.appendChild(gd);
    const out = [];
    for (let k = 0; k < 20; k++) {
        const x = [], y = [];
        for (let i = 0; i < 1000; i++) { x.push(i + k); y.push(Math.sin(i / 50 + k)); }
        const t = performance.now();
        Plotly.react(gd, [{type: 'scatter', x, y, mode: 'lines'}], {height: 400, uirevision: 1});
        out.push(performance.now() - t);
    }
    Plotly.purge(gd); gd.remove();
    out.sort((a, b) => a - b);
    return out[10];
}"""


def browser_updates(payloads: list[dict[str, Any]], chromium: str) -> dict[str, Any]:
    """Replay the payloads in Chromium (no server): main-thread ms per live update."""
    import plotly
    from playwright.sync_api import sync_playwright

    from app.live.component import SCRIPTS, STATIC, style

    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    scripts = "".join(f"<script src='{(STATIC / name).as_uri()}'></script>" for name in SCRIPTS)
    html = (
        "<html><head><meta charset='utf-8'></head><body><div id='root' style='width:1400px'>"
        f"</div><script src='{plotly_js.as_uri()}'></script>{scripts}</body></html>"
    )
    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "updates.html"
        page_file.write_text(html)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1300})
            page.goto(page_file.as_uri())
            page.wait_for_function("() => window.stepscopeLive && window.Plotly")
            out = page.evaluate(BROWSER_JS, [payloads, style()])
            out["floor"] = page.evaluate(FLOOR_JS)
            browser.close()
    return out


def update_cost(args: argparse.Namespace) -> None:
    if args.trace:
        from instrumentation.trace import read_jsonl

        messages = list(read_jsonl(args.trace))
        what = str(args.trace)
    else:
        steps = max(args.windows) + 40 * args.batch
        say(f"recording {steps} steps of {args.requests} requests")
        messages = busy_recording(steps, args.requests)
        what = f"{args.requests} requests"
    print(f"\none live update: {what}, {args.batch} new steps per update\n")
    headers = ["steps in view", "python ms/update", "KB/update", "reset KB"]
    if args.browser:
        headers += ["browser ms median", "p90", "floor ms", "detail"]
    rows = []
    for window in args.windows:
        payloads, times, sizes = live_updates(messages, window, args.batch)
        row: list[Any] = [window, statistics.median(times[1:]) * 1e3,
                          statistics.median(sizes[1:]) / 1024, f"{sizes[0] / 1024:.0f}"]  # fmt: skip
        if args.browser:
            b = browser_updates(payloads, args.chromium)
            row += [b["median"], b["p90"], b["floor"], b["lod"]]
        rows.append(row)
    print(table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.page_rate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=None, help="requests decoding (16; 64 with "
                    "--update-cost)")  # fmt: skip
    ap.add_argument("--chromium", default="/usr/bin/chromium", help="the browser Playwright runs")
    lv = ap.add_argument_group("live")
    lv.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' or a model directory")
    lv.add_argument("--device", default="cpu")
    lv.add_argument("--max-tokens", type=int, default=400, help="each request's (then replaced)")
    lv.add_argument("--seconds", type=float, default=30.0)
    lv.add_argument("--runs", type=int, default=1, help="measurements in a row, same processes")
    lv.add_argument("--engine-args", default="", help="extra engine.server flags")
    lv.add_argument("--root", type=Path, default=ROOT, help="the checkout whose page to measure")
    uc = ap.add_argument_group("--update-cost")
    uc.add_argument("--update-cost", action="store_true", help="one update's cost, no server")
    uc.add_argument("--windows", type=int, nargs="+", default=[500, 5_000], help="steps in view")
    uc.add_argument("--trace", type=Path, help="a recording to replay (default: one made here)")
    uc.add_argument("--batch", type=int, default=5, help="new steps per update")
    uc.add_argument("--browser", action="store_true", help="replay the updates in Chromium")
    args = ap.parse_args(argv)
    if args.requests is None:
        args.requests = 64 if args.update_cost else 16
    if args.requests < 1 or args.batch < 1 or args.runs < 1:
        ap.error("--requests, --batch and --runs must be at least 1")
    if args.update_cost:
        update_cost(args)
    else:
        live(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
