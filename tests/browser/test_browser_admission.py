"""The "KV pressure" preset in a real browser: played under `reserve`
then under `optimistic` on a small pool. Under reserve the requests table says why requests wait
and the KV chart never shows the pool full; under optimistic the timeline marks retractions and
the KV chart shows pool-full moments. With STEPSCOPE_SCREENSHOTS set, the README's screenshots
are saved there."""

from __future__ import annotations

import json
from pathlib import Path

from tests.browser import test_browser_live
from tests.browser.harness import act_until, running_app, running_engine, status_line, tab
from tests.browser.test_browser_live import SHOTS, TIMELINE, sync_api

N_PRESET = 16  # the preset's requests
FLAGS = ("--num-pages", "640", "--max-extend-tokens", "64", "--policy", "mixed", "--threads", "1")

TRACE_POINTS_JS = """([sel, name]) => {
    const gd = document.querySelector(sel);
    if (!gd || !gd.data) return -1;
    const t = gd.data.find(t => t.name === name);
    return t && t.x ? t.x.length : 0;
}"""
KV = ".stepscope-live .sl-kv"
# the hover texts of the waiting lanes: each says, step by step, why the queue's head waited
WAIT_HOVER_JS = f"""() => {{
    const gd = document.querySelector('{TIMELINE}');
    const t = gd && gd.data ? gd.data.find(t => t.name === 'waiting') : null;
    return t && t.customdata ? t.customdata.map(String) : [];
}}"""


def _play(page: object, ws: object, until: object, while_running: object = None) -> list[dict]:
    """Click the preset (then check `while_running()`) and follow the engine's messages until
    `until(messages)` holds."""
    page.get_by_role("button", name="KV pressure").click()  # type: ignore[attr-defined]
    if while_running is not None:
        while_running()  # type: ignore[operator]
    seen: list[dict] = []
    while not until(seen):  # type: ignore[operator]
        seen.append(json.loads(ws.recv(timeout=300)))  # type: ignore[attr-defined]
    return seen


def _finished(n: int) -> object:
    return lambda seen: sum(m.get("type") == "request" and m.get("event") == "finished"
                            for m in seen) >= n  # fmt: skip


def _retracted(seen: list[dict]) -> bool:
    return sum(len(m.get("retracted") or ()) for m in seen if m.get("type") == "step") >= 3


def _points(page: object, sel: str, name: str) -> int:
    return int(page.evaluate(TRACE_POINTS_JS, [sel, name]))  # type: ignore[attr-defined]


def _view(page: object, view: str) -> None:
    page.locator(f".stepscope-live button[data-view='{view}']").click()  # type: ignore[attr-defined]


def test_kv_pressure_preset_under_both_admission_modes(tiny_llama_dir: Path) -> None:
    from websockets.sync.client import connect

    # max_queue=None: the test stops reading while the preset still runs; with a bounded queue
    # the client stopped reading the socket, so its close waited out close_timeout (10 s)
    with (
        running_engine(tiny_llama_dir, *FLAGS) as engine,
        running_app(engine) as app,
        tab(app, timeout_ms=120_000) as page,
        connect(engine, max_size=2**27, max_queue=None) as ws,
    ):
        ws.recv()  # hello
        sync_api.expect(page.get_by_text("connected", exact=True)).to_be_visible()

        # reserve: a few run, the rest wait for promised pages, and their waiting lanes say so;
        # the pool never fills
        seen = _play(page, ws, _finished(N_PRESET // 4))  # the first wave through the pool
        steps = [m for m in seen if m.get("type") == "step"]
        assert not any(s.get("retracted") for s in steps)
        assert "reserved" in {s["queue"]["waiting_reason"] for s in steps}
        page.wait_for_function(f"() => ({TRACE_POINTS_JS})(['{TIMELINE}', 'retracted']) === 0")
        page.wait_for_function(f"() => ({WAIT_HOVER_JS})().some(h => /: reserved/.test(h))")
        _view(page, "kv")
        page.wait_for_function(f"() => ({TRACE_POINTS_JS})(['{KV}', 'pool full']) === 0")
        if SHOTS:
            page.mouse.move(5, 5)
            page.locator(".stepscope-live").screenshot(
                path=str(Path(SHOTS) / "kv-pressure-reserve.png")
            )
        _view(page, "timeline")

        # optimistic: more run at once, the pool fills, requests are retracted and recomputed
        act_until(
            lambda: page.get_by_text("optimistic (SGLang's)").click(),
            status_line(page, "admission=optimistic"),
        )
        seen = _play(page, ws, _retracted)
        steps = [m for m in seen if m.get("type") == "step"]
        assert sum(len(s.get("retracted") or ()) for s in steps) >= 3
        page.wait_for_function(f"() => ({TRACE_POINTS_JS})(['{TIMELINE}', 'retracted']) > 0")
        if SHOTS:
            page.mouse.move(5, 5)  # no tooltip over the charts
            page.locator(".stepscope-live").screenshot(
                path=str(Path(SHOTS) / "kv-pressure-optimistic.png")
            )
        _view(page, "kv")
        page.wait_for_function(f"() => ({TRACE_POINTS_JS})(['{KV}', 'pool full']) > 0")
        if SHOTS:
            page.locator(".stepscope-live").screenshot(path=str(Path(SHOTS) / "kv-pressure-kv.png"))


pytestmark = test_browser_live.pytestmark
