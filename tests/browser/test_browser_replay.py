"""Replay, compare and a sweep folder in Debian's chromium: a recording opened in the page,
scrubbed, compared with a second run, that run opened, and a sweep's trade-off plot (the
recordings are tests/app/test_replay.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.replay import Recording
from tests.app.test_replay import record_runs


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return record_runs(tiny_llama_dir, tmp_path_factory.mktemp("runs"))


@pytest.fixture
def replay_page(runs: dict) -> Iterator[str]:
    """The page with nothing answering at its URL, no autostart: recordings are opened in it."""
    from tests.browser.harness import free_port, running_app

    with running_app(f"ws://127.0.0.1:{free_port()}") as url:
        yield url


@pytest.mark.browser
def test_browser_opens_scrubs_and_compares(replay_page: str, runs: dict, tmp_path: Path) -> None:
    from tests.browser.harness import CHROMIUM, act_until, enter_text, tab

    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    expect = sync_api.expect
    rec = Recording.load(runs["a"])
    with tab(replay_page, timeout_ms=120_000) as page:
        box = page.locator(".st-key-replay_path input")

        act_until(
            lambda: enter_text(box, str(runs["a"])), page.get_by_text("replaying", exact=True)
        )
        # nothing that would command an engine is offered, and the page says why
        sidebar = page.locator("[data-testid='stSidebar']")
        expect(sidebar.get_by_text("no engine to act on", exact=False)).to_be_visible()
        expect(page.get_by_role("button", name="Submit")).to_have_count(0)
        expect(page.get_by_role("button", name="The chapter's example")).to_have_count(0)
        expect(page.locator(".st-key-budget_slider")).to_have_count(0)
        expect(sidebar.get_by_text("connected", exact=True)).to_have_count(0)
        caption = page.get_by_text(f"step {rec.last_step} of")
        expect(caption).to_be_visible()
        # scrub: the slider (a range input), keyboard Home = the first step. A key press can
        # be lost to a rerun (seen on a loaded CI run: the slider at 0, the caption still at
        # the last step), and pressing Home again on a slider at 0 changes nothing; so each
        # try starts at the end (End), then moves, and ends where it says from anywhere
        thumb = page.locator(".st-key-replay_step input[type='range']")

        def keys(*names: str) -> None:
            thumb.focus()
            for name in ("End", *names):
                thumb.press(name)

        act_until(lambda: keys("Home"), page.get_by_text(f"step {rec.first_step} of"))
        second = page.get_by_text(f"step {rec.first_step + 2} of")
        act_until(lambda: keys("Home", "ArrowRight", "ArrowRight"), second)
        # compare with the second run, then open it in the page
        page.get_by_text("Compare with…").click()
        other = page.locator(".st-key-compare_path input")
        heading = page.get_by_role("heading", name="Compare")

        act_until(
            lambda: enter_text(other, str(runs["b"])), heading, again=lambda: heading.count() == 0
        )
        # the comparison: two charts drawn whole by the component, on one x range, and
        # zooming one zooms the other
        compared = (
            "[...document.querySelectorAll('.stepscope-live')]"
            ".filter(r => r.querySelector('.sl-title').textContent)"
            ".map(r => r.querySelector('.sl-timeline'))"
        )
        page.wait_for_function(
            f"() => {{ const p = {compared}; return p.length === 2 && p.every(g => g._fullLayout); }}"
        )
        ranges = page.evaluate(f"() => {compared}.map(g => g._fullLayout.xaxis.range)")
        assert ranges[0] == ranges[1]
        page.evaluate(f"() => Plotly.relayout({compared}[0], {{'xaxis.range': [0.1, 0.3]}})")
        page.wait_for_function(
            f"() => {{ const r = {compared}[1]._fullLayout.xaxis.range; "
            "return Math.abs(r[0] - 0.1) < 1e-9 && Math.abs(r[1] - 0.3) < 1e-9; }"
        )
        open_b = page.get_by_role("button", name="Open B (mixed-16.jsonl) in the page")
        # the page now replays B: the sidebar names it, and the scrubber is at its end
        replaying = page.locator("[data-testid='stSidebar'] code", has_text="mixed-16.jsonl")
        act_until(open_b.click, replaying, again=lambda: open_b.count() == 1)
        last_b = Recording.load(runs["b"]).last_step
        expect(page.get_by_text(f"step {last_b} of").first).to_be_visible()
        # the sweep folder: its trade-off plot in the component, the y metric picked in the
        # page, and a click on prefill-first's point opens that run
        page.get_by_text("Open sweep folder").click()
        folder = page.locator(".st-key-sweep_path input")
        sweep = page.locator(".stepscope-sweep")
        act_until(lambda: enter_text(folder, str(runs["dir"])), sweep)
        expect(sweep).to_have_attribute("data-runs", "2")
        expect(sweep).to_have_attribute("data-metric", "worst_stall_s")
        sweep.get_by_role("button", name="ITL p99.9").click()
        expect(sweep).to_have_attribute("data-metric", "itl_p999_s")
        click = (
            "() => { const gd = document.querySelector('.stepscope-sweep .sl-sweep');"
            " const t = gd.data.find((d) => d.name === 'prefill_first');"
            " gd.emit('plotly_click', {points: [{customdata: t.customdata[0]}]}); }"
        )
        back = page.locator("[data-testid='stSidebar'] code", has_text="prefill_first-16.jsonl")
        act_until(lambda: page.evaluate(click), back)
        shot = tmp_path / "replay.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
