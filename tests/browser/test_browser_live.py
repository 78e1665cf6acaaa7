"""The live page in Debian's chromium against real engines (tiny random Llama).

- One page through one busy stretch of the engine: the KV page map marks a shared prefix and
  frees an aborted request's cells; a zoom (`Plotly.relayout`, as a drag does) survives ten live
  updates while new steps are drawn; the Requests tab's Abort button ends a request and says so.
  (A prompt held until the engine is up: test_browser_first_minute.)
- A chart script that failed to load is loaded again.
- On request, a measurement: 64 requests in flight and 5,000 steps in view: the bytes the page's
  own WebSocket receives per second and the chart updates per second (the DevTools protocol's
  frame events), and the main-thread time of each live update (the Performance API). How fast
  the page keeps up with the engine is `python -m bench.page_rate`'s question.

Numbers go to stdout and, with STEPSCOPE_BENCH_OUT=path, to a JSON file (docs/benchmarks.md).
STEPSCOPE_BROWSER_BENCH=1 runs the 64-request measurement (minutes: skipped otherwise).
STEPSCOPE_BROWSER_STEPS sets its steps in view (default 600; the recorded figures use 5,000).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.browser_floor import FLOOR_JS
from tests.browser.harness import (
    CHROMIUM,
    Workload,
    act_until,
    running_app,
    running_engine,
    status_line,
    tab,
)
from tests.server.test_server_support import ProtoClient

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium"
    ),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

# 5,000 for the recorded figures; the suite's default keeps its time (the steps are made live)
STEPS = int(os.environ.get("STEPSCOPE_BROWSER_STEPS", "600"))
REQUESTS = 64
MEASURE_S = 12.0  # the measurement's window
SHOTS = os.environ.get("STEPSCOPE_SCREENSHOTS")  # a folder: README screenshots are saved there

LIVE = ".stepscope-live"
TIMELINE = ".stepscope-live .sl-timeline"
_UPDATES_JS = f"() => (document.querySelector('{LIVE}') || {{dataset: {{}}}}).dataset.updates"


def dataset(page: object) -> dict:
    return page.evaluate(  # type: ignore[attr-defined]
        f"() => {{ const r = document.querySelector('{LIVE}'); "
        "return r ? Object.assign({}, r.dataset) : {}; }"
    )


def updates(page: object) -> int:
    return int(dataset(page).get("updates") or 0)


# ---- a busy engine: 64 requests in flight, always -------------------------------------------


class FrameMeter:
    """Counts what the page's WebSocket receives, through the DevTools protocol."""

    def __init__(self, page: object, marker: bytes) -> None:
        self.page, self.marker = page, marker
        self.frames: list[tuple[float, int, bool]] = []  # (time, bytes, carries the chart)
        cdp = page.context.new_cdp_session(page)  # type: ignore[attr-defined]
        cdp.send("Network.enable")
        cdp.on("Network.webSocketFrameReceived", self._on_frame)

    def _on_frame(self, event: dict) -> None:
        resp = event["response"]
        data = resp["payloadData"]
        raw = base64.b64decode(data) if resp.get("opcode") == 2 else data.encode()
        self.frames.append((time.monotonic(), len(raw), self.marker in raw))

    def measure(self, seconds: float) -> tuple[float, float]:
        """(bytes per second, chart updates per second) over the next `seconds`."""
        t0 = time.monotonic()
        # waiting through playwright keeps delivering the DevTools events as they come
        self.page.wait_for_timeout(seconds * 1000)  # type: ignore[attr-defined]
        t1 = time.monotonic()
        got = [f for f in self.frames if t0 <= f[0] < t1]
        return sum(f[1] for f in got) / (t1 - t0), sum(f[2] for f in got) / (t1 - t0)


def _zoom_survives_live_updates(page: object) -> None:
    """Zoom as a drag does: the range survives ten updates, new steps keep coming and are
    drawn outside it, and the zoomed-in view shows per-request segments again."""
    last = int(dataset(page)["last"])
    lo, hi = last - 80.5, last - 30.5  # 50 steps: under the segment budget at 64 requests
    page.evaluate(  # type: ignore[attr-defined]
        f"() => Plotly.relayout(document.querySelector('{TIMELINE}'), "
        f"{{'xaxis.range': [{lo}, {hi}]}})"
    )
    u1 = updates(page)
    page.wait_for_function(f"() => Number(({_UPDATES_JS})()) >= {u1 + 10}")  # type: ignore[attr-defined]
    rng = page.evaluate(f"() => document.querySelector('{TIMELINE}')._fullLayout.xaxis.range")  # type: ignore[attr-defined]
    assert abs(rng[0] - lo) < 1e-6 and abs(rng[1] - hi) < 1e-6
    after = dataset(page)
    assert int(after["last"]) > last  # new steps arrived ...
    drawn = page.evaluate(  # type: ignore[attr-defined]
        f"() => Math.max(...document.querySelector('{TIMELINE}').data"
        ".find(t => t.name.startsWith('budget')).x)"
    )
    assert drawn > last + 0.5  # ... and are drawn, outside the zoomed range
    assert after["lod"] == "segments"  # zoomed in: per-request detail again


def _set_window(page: object, presses: int) -> None:
    slider = page.locator(".st-key-window input[type='range']")  # type: ignore[attr-defined]
    slider.focus()
    for _ in range(presses):
        slider.press("ArrowRight")
        time.sleep(0.5)


# A measurement of minutes (its steps are made live, 5-20 a second on CPU): a benchmark, run on
# request only (STEPSCOPE_BROWSER_BENCH=1), so the suite stays within its time
@pytest.mark.skipif(
    os.environ.get("STEPSCOPE_BROWSER_BENCH") != "1",
    reason="a benchmark of minutes: set STEPSCOPE_BROWSER_BENCH=1 to run it",
)
@pytest.mark.timeout(max(1200, 2 * STEPS))
def test_live_page_at_64_requests_and_5000_steps(tiny_llama_dir: Path) -> None:
    windows = (100, 250, 500, 1000, 2000, 5000)  # app.session.WINDOWS; 500 is the default
    window = min(w for w in windows if w >= STEPS)
    presses = windows.index(window) - windows.index(500)
    flags = ["--max-running-req", str(REQUESTS), "--max-extend-tokens", "256"]
    flags += ["--policy", "mixed", "--threads", "1"]
    result: dict[str, float] = {"steps_in_view": STEPS, "requests": REQUESTS}
    with (
        running_engine(tiny_llama_dir, *flags) as engine,
        running_app(engine) as app,
        tab(app, timeout_ms=120_000) as page,
    ):
        sync_api.expect(page.get_by_text("connected", exact=True)).to_be_visible()
        meter = FrameMeter(page, b"stepscope.live")
        _set_window(page, presses)
        with Workload(engine, REQUESTS, max_tokens=900) as load:
            page.wait_for_function(
                f"() => {{ const r = document.querySelector('{LIVE}'); "
                f"return r && Number(r.dataset.steps) >= {STEPS}; }}",
                timeout=STEPS * 1000,
            )
            u0, s0 = updates(page), load.steps
            t0 = time.monotonic()
            result["live_bytes_per_s"], result["live_frames_per_s"] = meter.measure(MEASURE_S)
            span = time.monotonic() - t0
            result["live_updates_per_s"] = (updates(page) - u0) / span
            result["engine_steps_per_s"] = (load.steps - s0) / span
            times = page.evaluate(
                "(n) => performance.getEntriesByName('stepscope-update').slice(-n)"
                ".map(e => e.duration)",
                max(int(result["live_updates_per_s"] * MEASURE_S), 1),
            )
            pulls = page.evaluate(
                "() => performance.getEntriesByName('stepscope-pull').slice(-40)"
                ".map(e => e.duration)"
            )
            if pulls:  # from a pull to its answer: Streamlit's round trip (and the hold)
                result["pull_round_trip_ms_median"] = statistics.median(pulls)
            result["live_update_ms_median"] = statistics.median(times)
            result["live_update_ms_p90"] = sorted(times)[int(0.9 * (len(times) - 1))]
            result["plotly_floor_ms"] = page.evaluate(FLOOR_JS)
            result["live_bytes_per_update"] = result["live_bytes_per_s"] / max(
                result["live_updates_per_s"], 1e-9
            )
            info = dataset(page)
            assert int(info["steps"]) >= STEPS
            if SHOTS:
                page.screenshot(path=str(Path(SHOTS) / "live-64-requests.png"))
            _zoom_survives_live_updates(page)
    print(json.dumps(result, indent=1))
    if os.environ.get("STEPSCOPE_BENCH_OUT"):
        Path(os.environ["STEPSCOPE_BENCH_OUT"]).write_text(json.dumps(result, indent=1))


# ---- the KV page map, abort, and the first minute ----------------------------------------------


def _open_tab(page: object, name: str, shown: object = None) -> None:
    """Open a detail tab; with `shown` (a locator of what the server draws in it), until that
    is visible. Twice in ~30 runs the browser showed the Requests tab selected while no run of
    the server drew its content (120 s without its Abort button; the cause is not established:
    a fragment's rerun racing the click is suspected). A user clicks away and back; so does this."""
    tab = page.get_by_role("tab", name=name)  # type: ignore[attr-defined]
    selected = page.get_by_role("tab", name=name, selected=True)  # type: ignore[attr-defined]
    if shown is None:
        act_until(tab.click, selected)
        return

    def reopen() -> None:
        if selected.count():
            other = "Output text" if name != "Output text" else "Requests"
            page.get_by_role("tab", name=other).click()  # type: ignore[attr-defined]
            sync_api.expect(page.get_by_role("tab", name=other, selected=True)).to_be_visible()  # type: ignore[attr-defined]
        tab.click()

    act_until(reopen, shown)


SUMMARY_JS = """() => {
    const r = document.querySelector('.stepscope-kvmap');
    return r && r.dataset.summary ? JSON.parse(r.dataset.summary) : null;
}"""


def _submit_ids(client: ProtoClient, cid: str, ids: list[int], max_tokens: int) -> int:
    """Submit token ids over the protocol and return the request's uid."""
    cmd = {"type": "submit", "id": cid, "input_ids": ids, "max_tokens": max_tokens}
    reply = client.reply({**cmd, "ignore_eos": True})
    assert reply["type"] == "accepted", reply
    return int(reply["uid"])


def test_page_map_zoom_and_abort_while_two_requests_share_a_prefix(
    live_app: tuple[str, str],
) -> None:
    """One page, one busy stretch of the engine:
    - a short request leaves a 256-token prefix in the radix cache; two long requests that start
      with it both hit it, and the KV page map marks those pages shared;
    - aborting one frees its own cells in the first map read after the abort, while the other
      keeps its;
    - a zoom survives ten live updates while the other decodes on (see
      `_zoom_survives_live_updates`);
    - the Abort button in the Requests tab then ends it, and the page says so."""

    engine, app = live_app
    rng = random.Random(5)
    prefix = [rng.randrange(3, 40000) for _ in range(256)]

    def suffix() -> list[int]:
        return [rng.randrange(3, 40000) for _ in range(40)]

    with tab(app, timeout_ms=120_000) as page, contextlib.closing(ProtoClient(engine)) as client:
        sync_api.expect(page.get_by_text("connected", exact=True)).to_be_visible()
        _open_tab(page, "KV page map")
        seed = _submit_ids(client, "seed", prefix + suffix(), 1)
        # its prompt is in the prefix cache once it finished (the event may come before the
        # reply to its submit: the client keeps it)
        client.until(lambda m: m["type"] == "request" and m.get("uid") == seed
                     and m.get("event") == "finished")  # fmt: skip
        # long enough to outlast the test on any machine: both are aborted below
        first = _submit_ids(client, "a", prefix + suffix(), FIRST_TOKENS)
        second = _submit_ids(client, "b", prefix + suffix(), SECOND_TOKENS)
        page.wait_for_function(
            f"() => {{ const s = ({SUMMARY_JS})(); return s && s.shared >= 256 "
            f"&& (s.owners['{first}'] || 0) > 0 && (s.owners['{second}'] || 0) > 0; }}"
        )
        if SHOTS:
            page.mouse.move(5, 1200)
            page.locator(".stepscope-kvmap").screenshot(path=str(Path(SHOTS) / "kv-page-map.png"))
        client.send({"type": "abort", "id": "x", "uid": second})
        # the broadcast `aborted` event says when the engine let it go
        t_abort = client.until(lambda m: m["type"] == "request" and m.get("uid") == second
                               and m.get("event") == "aborted")["t"]  # fmt: skip
        # the first page map read after the abort no longer shows it; the other still holds its
        page.wait_for_function(f"() => ({SUMMARY_JS})().t > {t_abort}")
        first_after = page.evaluate(SUMMARY_JS)
        assert str(second) not in first_after["owners"]
        assert first_after["owners"].get(str(first), 0) > 0
        # the other decodes on: enough steps drawn to zoom into the 80 before the last
        page.wait_for_function(
            f"() => Number((document.querySelector('{LIVE}') || {{dataset: {{}}}})"
            ".dataset.steps) >= 100"
        )
        _zoom_survives_live_updates(page)
        # a click lost to a rerun is clicked again; one that aborted is not (a second abort of
        # the same request is refused: not in flight), however long the page takes to say so
        abort = page.locator(f".st-key-abort-{first} button").first
        _open_tab(page, "Requests", abort)
        act_until(
            abort.click,
            status_line(page, f"request {first} aborted"),
            again=lambda: (
                page.get_by_test_id("stAlertContentError").count() == 0 and abort.count() > 0
            ),
            each_ms=45_000,
        )
        assert page.get_by_test_id("stAlertContentError").count() == 0


def test_a_chart_script_that_failed_to_load_is_loaded_again(live_app: tuple[str, str]) -> None:
    """plotly.js, then one of the charts' own files, fail once on their way (a busy server, a
    dropped connection): the page loads them again by itself, and the charts are drawn, rather
    than a page without charts for good (an idle engine sends no update that would retry)."""
    failed: list[str] = []

    def once(route: object) -> None:
        name = route.request.url.split("?")[0].rsplit("/", 1)[1]  # type: ignore[attr-defined]
        if name not in failed:
            failed.append(name)
            route.abort()  # type: ignore[attr-defined]
        else:
            route.continue_()  # type: ignore[attr-defined]

    warnings: list[str] = []
    with tab(None, timeout_ms=60_000) as page:
        page.on("console", lambda m: warnings.append(m.text) if m.type == "warning" else None)
        page.route("**/plotly.min.js", once)  # routing turns the browser's cache off
        page.route("**/view.js*", once)
        page.goto(live_app[1])
        sync_api.expect(page.locator(".stepscope-live")).to_have_count(1)
        page.wait_for_function("() => !!window.Plotly")
    assert failed == ["plotly.min.js", "view.js"], failed
    assert any("did not load; loading again in 1 s" in w for w in warnings), warnings


# the two long requests' outputs: their reservations (with their 296-token prompts) fit the pool
# together. The second is aborted early; the first decodes alone from then on, for minutes even
# on a quiet machine (a loaded one ran the test for three, and 30,000 tokens ended before its
# Abort button was clicked)
FIRST_TOKENS = 44_900
SECOND_TOKENS = 20_000
LONG_CONTEXT = 65_536


@pytest.fixture(scope="module")
def tiny_llama_long_dir(smollm2_dir: Path) -> Path:
    """The tiny Llama with a 65,536-token context: room for a request that outlasts a click."""
    from tests.models import cached_tiny

    return cached_tiny("llama", smollm2_dir, max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def live_app(tiny_llama_long_dir: Path) -> Iterator[tuple[str, str]]:
    """One engine and one page server for the module's tests (each opens its own page): a
    64-token budget for the page map's prefix, and room for two long requests."""
    flags = ("--max-running-req", "16", "--policy", "mixed", "--threads", "1")
    flags += ("--max-extend-tokens", "64", "--max-seq-len", str(LONG_CONTEXT))
    flags += ("--num-pages", str(LONG_CONTEXT))
    with running_engine(tiny_llama_long_dir, *flags) as engine, running_app(engine) as app:
        yield engine, app
