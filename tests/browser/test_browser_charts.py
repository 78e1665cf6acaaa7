"""The live charts' component (app/live) in Debian's chromium, on a page of its own: the charts
over a synthetic engine record (tests/app/app_peer.py's SimEngine) that the test extends step by
step, with the sidebar's controls (Live, Steps in view, Clear history) and a pause banner that,
as the page's once did, moves the charts down the page so that Streamlit mounts them afresh.

No engine runs: the steps arrive when the test says, so "while the engine is idle" is exact.
What is checked is what only a browser shows: a chart mounted afresh while paused is drawn
(and zoomable) from the frozen view, a narrower window applies at once, and a cleared history
drops the user's zoom.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.harness import (
    CHROMIUM,
    ROOT,
    free_port,
    stop_process,
    tab,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium"
    ),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

FIRST_STEPS = 300
MORE_STEPS = 40

# Each browser tab is a session with its own record: the tests do not share steps.
PAGE = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import streamlit as st
from app.live.component import live_charts
from app.live.feed import ViewOptions
from app.state import EventStore
from tests.app.app_peer import synthetic_trace

HELLO = {{"type": "hello", "protocol": 1, "now": 0.0, "seq": -1,
          "engine": {{"model": "sim", "page_size": 16, "num_pages": 20000, "instance": "s1"}},
          "config": {{"max_extend_tokens": 128, "policy": "mixed"}},
          "history": {{"steps": [], "requests": []}}}}
ss = st.session_state
if "store" not in ss:
    ss.store, ss.messages, ss.next = EventStore(), synthetic_trace(1200), 0
    ss.store.apply(HELLO)


def more(steps):
    n = 0
    while n < steps and ss.next < len(ss.messages):
        msg = ss.messages[ss.next]
        ss.store.apply({{**msg, "seq": ss.next}})
        ss.next += 1
        n += msg["type"] == "step"


if "started" not in ss:
    more({FIRST_STEPS})
    ss.started = True
with st.sidebar:
    live = st.toggle("Live", value=True, key="live")
    window = st.select_slider("Steps in view", options=[50, 100, 200, 500], value=500, key="window")
    st.button("More steps", on_click=more, args=({MORE_STEPS},))
    st.button("Clear history", on_click=lambda: ss.store.clear())
if not live:  # not in a container of its own: the charts below move, and mount afresh
    st.info("Paused: the charts are frozen so you can zoom and hover.")
opts = ViewOptions(window=window, xmode="step", paused=not live)


@st.fragment
def charts():
    live_charts(ss.store, "charts", opts, lambda policy: {{"timeline": "t", "kv": "k",
                                                          "progress": "p", "latency": "l"}})


charts()
"""

LIVE = ".stepscope-live"
TIMELINE = ".stepscope-live .sl-timeline"
STATE_JS = f"""() => {{
    const r = document.querySelector('{LIVE}');
    const gd = document.querySelector('{TIMELINE}');
    const x = gd && gd._fullLayout ? gd._fullLayout.xaxis : null;
    return r ? {{steps: Number(r.dataset.steps || 0), last: r.dataset.last,
                status: r.querySelector('.sl-status').textContent,
                height: gd ? gd.getBoundingClientRect().height : 0,
                traces: gd && gd.data ? gd.data.length : 0,
                autorange: x ? x.autorange : null, range: x ? x.range : null}} : null;
}}"""


@contextlib.contextmanager
def running_page() -> Iterator[str]:
    """`streamlit run` on the page above, on a free port; yields its URL."""
    with tempfile.TemporaryDirectory(prefix="charts-page-") as folder:
        script = Path(folder) / "charts_page.py"
        script.write_text(PAGE)
        port = free_port()
        argv = [sys.executable, "-m", "streamlit", "run", str(script), "--server.headless", "true"]
        argv += ["--server.port", str(port), "--browser.gatherUsageStats", "false"]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health") as r:
                        if r.status == 200:
                            break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.2)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process(proc)


@pytest.fixture(scope="module")
def charts_page() -> Iterator[str]:
    with running_page() as url:
        yield url


@pytest.fixture
def page(charts_page: str) -> Iterator[object]:
    """A new tab (a new session, with its own record) on the module's page server."""
    with tab(charts_page, timeout_ms=60_000) as page:
        _wait(page, f"s.steps === {FIRST_STEPS} && s.traces > 0")
        yield page


def _state(page: object) -> dict:
    return page.evaluate(STATE_JS)  # type: ignore[attr-defined]


def _wait(page: object, condition: str) -> dict:
    """Until the charts' state `s` (STATE_JS) meets `condition`; then that state."""
    page.wait_for_function(f"() => {{ const s = ({STATE_JS})(); return !!s && ({condition}); }}")  # type: ignore[attr-defined]
    return _state(page)


def _click(page: object, name: str) -> None:
    page.get_by_role("button", name=name).click()  # type: ignore[attr-defined]


def _zoom(page: object, lo: float, hi: float) -> None:
    page.evaluate(  # type: ignore[attr-defined]
        f"() => Plotly.relayout(document.querySelector('{TIMELINE}'), "
        f"{{'xaxis.range': [{lo}, {hi}]}})"
    )


def _window(page: object, presses: int) -> None:
    """Move Steps in view by `presses` options (negative: narrower)."""
    slider = page.locator(".st-key-window input[type='range']")  # type: ignore[attr-defined]
    slider.focus()
    for _ in range(abs(presses)):
        slider.press("ArrowLeft" if presses < 0 else "ArrowRight")
        time.sleep(0.5)


def test_charts_mounted_afresh_while_paused_draw_the_frozen_view(page: object) -> None:
    before = _state(page)
    page.get_by_text("Live", exact=True).click()  # type: ignore[attr-defined]  # the banner moves the charts
    sync_api.expect(page.get_by_text("Paused: the charts are frozen")).to_be_visible()  # type: ignore[attr-defined]
    paused = _wait(page, "s.status.includes('paused') && s.traces > 0")
    # every step that was in view, drawn at full height (not a 32 px strip of buttons)
    assert paused["steps"] == FIRST_STEPS and paused["last"] == before["last"]
    assert paused["height"] > 300
    # zoomable, and the zoom holds while the engine runs on behind the frozen charts
    last = int(paused["last"])
    _zoom(page, last - 40.5, last - 10.5)
    _wait(page, f"Math.abs(s.range[0] - {last - 40.5}) < 1e-3")  # drawn zoomed
    _click(page, "More steps")
    page.wait_for_timeout(2_000)  # a full run and its answer
    held = _state(page)
    assert held["steps"] == FIRST_STEPS and held["last"] == before["last"]
    assert [round(x, 3) for x in held["range"]] == [last - 40.5, last - 10.5]
    assert "30 in view" in held["status"]
    # live again: the steps made meanwhile are drawn
    page.get_by_text("Live", exact=True).click()  # type: ignore[attr-defined]
    _wait(page, f"Number(s.last) > {last} && !s.status.includes('paused')")


def test_a_narrower_window_applies_at_once_while_the_engine_is_idle(page: object) -> None:
    _window(page, -2)  # 500 -> 100 steps in view, and no step arrives
    _wait(page, "s.steps === 100")
    page.get_by_text("Live", exact=True).click()  # type: ignore[attr-defined]
    _wait(page, "s.status.includes('paused') && s.steps === 100")
    _window(page, -1)  # 50, paused
    _wait(page, "s.steps === 50")
    _window(page, 3)  # 500 again, still paused: the frozen view's 300 steps come back
    state = _wait(page, f"s.steps === {FIRST_STEPS}")
    assert "paused" in state["status"]


def test_clear_history_drops_the_zoom(page: object) -> None:
    last = int(_state(page)["last"])
    _zoom(page, last - 100.5, last - 50.5)
    _wait(page, "s.status.includes('50 in view')")
    _click(page, "Clear history")
    _wait(page, "s.steps === 0")
    _click(page, "More steps")
    state = _wait(page, f"s.steps === {MORE_STEPS}")
    # the next steps are drawn where the charts look: the old zoom went with the history
    assert f"{MORE_STEPS} in view" in state["status"], state
    assert state["autorange"] is True
