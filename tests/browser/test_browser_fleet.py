"""The fleet page in Debian's chromium: two live replicas (tiny random Llama) on one page. Both
replicas' charts move while each gets work, and a budget change applied to one replica changes
only that one (read back from each replica's own `/server_info`). A bad URL list gets a clear
error, not "connecting…" forever (the page run by AppTest: no browser needed to see an error).
STEPSCOPE_SCREENSHOTS=DIR saves the page as fleet.png."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from app.page.fleet import FleetSpec, clock_offsets, load_fleet_file, parse_engine_urls, spec_for
from engine.server.fleet import Fleet
from tests.browser.harness import CHROMIUM, Workload, running_app, tab

SHOTS = os.environ.get("STEPSCOPE_SCREENSHOTS")
LIVE = ".stepscope-live"


def test_url_lists_and_fleet_files_parse_or_say_what_is_wrong(tmp_path: Path) -> None:
    assert parse_engine_urls("ws://a:1, ws://b:2") == (("ws://a:1", "ws://b:2"), None)
    for bad, words in (
        ("ws://a:1,,ws://b:2", "empty entry"),
        ("ws://a:1,http://b:2", "URL 2 of 2"),
        ("ws://a:1,ws://a:1", "twice"),
    ):
        urls, problem = parse_engine_urls(bad)
        assert urls == () and problem is not None and words in problem, problem
    assert spec_for("ws://a:1", [], {}) == (None, None)  # one engine: the usual page
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"replicas": [{"ws": "ws://x:1"}, {"ws": "ws://y:2"}],
                                "gateway": "http://g:3"}))  # fmt: skip
    assert load_fleet_file(path) == FleetSpec(("ws://x:1", "ws://y:2"), "http://g:3", str(path))
    assert spec_for("ws://a:1", ["--fleet", str(path)], {})[0] == load_fleet_file(path)
    spec, problem = spec_for("ws://a:1", [], {"STEPSCOPE_FLEET": str(tmp_path / "none.json")})
    assert spec is None and problem is not None and "cannot read" in problem
    assert clock_offsets([{"clock_epoch": 100.5}, {"clock_epoch": 100.0}, None]) == [0.5, 0, 0]


def _budget(http: str) -> int:
    with urllib.request.urlopen(http + "/server_info", timeout=30) as resp:
        return int(json.loads(resp.read())["chunked_prefill_size"])


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed")
def test_two_live_replicas_move_and_a_budget_change_reaches_only_one(
    tiny_llama_dir: Path,
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    expect = sync_api.expect
    args = ["--model", str(tiny_llama_dir), "--threads", "1", "--max-extend-tokens", "64"]
    with Fleet(2, args, router_policy=None) as fleet:
        info = fleet.info
        assert info is not None
        urls = ",".join(r.ws for r in info.replicas)
        with running_app(urls) as page_url, tab(page_url, width=1500, height=1900) as page:
            expect(page.get_by_text("a fleet of 2 engines")).to_be_visible()
            charts = page.locator(LIVE)
            expect(charts).to_have_count(2)
            # both replicas get work, and both replicas' charts draw their new steps; the work
            # runs only while the charts are watched (two engines stepping flat out, with the
            # page folding every step, took most of the machine from the rest of the test)
            with (
                Workload(info.replicas[0].ws, 2, 48),
                Workload(info.replicas[1].ws, 2, 48),
            ):
                first = [int(charts.nth(i).get_attribute("data-updates") or 0) for i in (0, 1)]
                page.wait_for_function(
                    "([a, b]) => { const c = document.querySelectorAll('.stepscope-live');"
                    " return c.length === 2 && +c[0].dataset.updates > a + 2"
                    " && +c[1].dataset.updates > b + 2; }",
                    arg=first,
                )
            before = [_budget(r.http) for r in info.replicas]
            assert before == [64, 64]
            # replica 1 only: budget 16
            page.get_by_label("Apply to").click()
            page.get_by_role("option", name="replica 1").click()
            slider = page.get_by_role("slider", name="max_extend_tokens")
            slider.focus()
            for _ in range(2):  # 64 → 32 → 16 on the powers-of-two slider
                slider.press("ArrowLeft")
            expect(slider).to_have_attribute("aria-valuetext", "16")
            page.get_by_role("button", name="Apply").click()
            expect(page.get_by_text("replica 1: ")).to_be_visible()
            deadline = time.monotonic() + 30  # applied from the engine's next step
            while (after := [_budget(r.http) for r in info.replicas]) != [64, 16]:
                assert time.monotonic() < deadline, after
                time.sleep(0.2)
            if SHOTS:
                Path(SHOTS).mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(Path(SHOTS) / "fleet.png"), full_page=True)


def test_a_bad_url_list_is_a_clear_error_not_connecting_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The page as Streamlit runs it (AppTest: app/main.py, without a browser; nothing here is
    drawn by the browser): the error names the entry at fault on the first run, and nothing
    says it is connecting."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from tests.app.test_app_ui import APP, texts

    monkeypatch.setenv("STEPSCOPE_URL", "ws://127.0.0.1:1,http://127.0.0.1:2")
    monkeypatch.setenv("STEPSCOPE_AUTOSTART", "0")
    at = AppTest.from_file(APP, default_timeout=30)
    try:
        at.run()
        assert not at.exception, at.exception
        assert any("Engine URL 2 of 2" in t for t in texts(at.error)), texts(at.error)
        assert not any("onnecting" in t for t in texts(at.info) + texts(at.markdown))
    finally:
        st.cache_resource.clear()
