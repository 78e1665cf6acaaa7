"""The live page in Debian's chromium: a prompt's steps reach the charts chunked by the budget,
and the budget slider moves the budget for a later prompt. Then what a new user's first hour
showed the page getting wrong, each seen again: a refused form value, a refused budget, the
headline of an idle engine, the steps the headline covers, a retracted request's stall, and the
replay scrubber during playback.

One engine (the tiny random Llama, 600 KV pages, a budget of 32 under prefill-first, its record
written to a trace) and one page server serve the module; each test opens its own tab. The
replay test runs last: it opens the trace the others wrote.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.harness import (
    CHROMIUM,
    act_until,
    enter_text,
    running_app,
    running_engine,
    status_line,
    submit,
    tab,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium"
    ),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
expect = sync_api.expect
TIMEOUT_MS = 60_000
SHOTS = os.environ.get("STEPSCOPE_SCREENSHOTS")  # a folder: the README's screenshots go there
TIMELINE = ".stepscope-live .sl-timeline"


def shot(page: object, name: str) -> None:
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / name), full_page=False)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    trace = tmp_path_factory.mktemp("truth") / "run.jsonl"
    flags = ("--num-pages", "600", "--max-running-req", "8", "--threads", "1")
    flags += ("--max-extend-tokens", "32", "--policy", "prefill_first")
    flags += ("--http-port", "none", "--trace", str(trace))
    with running_engine(tiny_llama_dir, *flags) as engine, running_app(engine) as app:
        yield {"app": app, "trace": trace}


@pytest.fixture
def page(served: dict) -> Iterator[object]:
    """A new tab on the page, connected, with Clear history pressed (a fresh record)."""
    with tab(served["app"], timeout_ms=TIMEOUT_MS) as page:
        expect(page.get_by_text("connected", exact=True)).to_be_visible()
        page.get_by_role("button", name="Clear history").click()
        expect(page.get_by_text("history cleared")).to_be_visible()
        yield page


def metric(page: object, label: str) -> object:
    """The headline's metric named `label` (its value and its small line below)."""
    return page.locator("[data-testid='stMetric']", has_text=label)  # type: ignore[attr-defined]


# Reads the timeline figure as plotly.js drew it (its full, decoded traces).
LAST_BUDGET_JS = """() => {
    const gd = document.querySelector('.stepscope-live .sl-timeline');
    if (!gd || !gd.data) return null;
    const t = gd.data.find(t => (t.name || '').startsWith('budget'));
    return t && t.y && t.y.length ? Number(t.y[t.y.length - 1]) : null;
}"""
PROMPT_PIECES_JS = """(uid) => {
    const gd = document.querySelector('.stepscope-live .sl-timeline');
    if (!gd || !gd.data) return [];
    const t = gd.data.find(t => (t.name || '').startsWith('prompt chunk (hatched)'));
    if (!t || !t.customdata) return [];
    const out = [];
    for (let i = 0; i < t.customdata.length; i++) {
        if (Number(t.customdata[i][0]) === uid) out.push(Number(t.y[i]));
    }
    return out;
}"""


def submitted_uid(page: object) -> int:
    """The uid the status line names for the prompt just submitted."""
    line = status_line(page, re.compile(r"submitted: request \d+$"))
    expect(line).to_be_visible()
    return int(line.inner_text().rsplit(" ", 1)[1])


def test_submit_watch_steps_and_move_the_budget_slider(page: object, tmp_path: Path) -> None:
    """A prompt's steps reach the live charts in chunks of at most the budget (32, the engine's
    start); the slider moves the budget to 16, then 8, and a later prompt is chunked by 8."""
    page.get_by_text("ignore EOS").click()  # type: ignore[attr-defined]  # a random model may stop early
    submit(page, "The sea was calm and the boats were out. " * 6, 24)
    first = submitted_uid(page)
    page.wait_for_function(f"() => ({PROMPT_PIECES_JS})({first}).length >= 2")  # type: ignore[attr-defined]
    assert max(page.evaluate(PROMPT_PIECES_JS, first)) <= 32  # type: ignore[attr-defined]
    assert page.evaluate(LAST_BUDGET_JS) == 32  # type: ignore[attr-defined]

    slider = page.locator(".st-key-budget_slider input[type='range']")  # type: ignore[attr-defined]
    exact = page.locator(".st-key-budget_exact input")  # type: ignore[attr-defined]
    for old, new in [(32, 16), (16, 8)]:  # one step left each
        act_until(
            lambda: slider.press("ArrowLeft"),
            status_line(page, f"max_extend_tokens={new}"),
            again=lambda old=old: exact.input_value() == str(old),
        )
    expect(exact).to_have_value("8")

    submit(page, "A second prompt arrives after the budget changed. " * 4, 8)
    second = submitted_uid(page)
    assert second > first
    page.wait_for_function(f"() => ({LAST_BUDGET_JS})() === 8")  # type: ignore[attr-defined]
    page.wait_for_function(f"() => ({PROMPT_PIECES_JS})({second}).length >= 3")  # type: ignore[attr-defined]
    assert max(page.evaluate(PROMPT_PIECES_JS, second)) <= 8  # type: ignore[attr-defined]
    expect(page.get_by_text("budget 8").first).to_be_visible()  # type: ignore[attr-defined]
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot))  # type: ignore[attr-defined]
    assert shot.stat().st_size > 10_000


def test_a_bad_form_value_is_refused_with_a_message(page: object) -> None:
    """max_tokens 0 used to block Submit with a small red mark, leaving the last green notice."""
    submit(page, "Hi", 4)
    expect(page.get_by_text("submitted: request")).to_be_visible()
    submit(page, "Hi", 0)
    expect(page.get_by_text("max_tokens must be a whole number ≥ 1.")).to_be_visible()
    expect(page.get_by_text("submitted: request")).to_have_count(0)


def test_an_emptied_or_lettered_budget_box_is_refused(page: object) -> None:
    """Letters (or an empty box) and Enter used to set the budget to 1."""
    box = page.locator(".st-key-budget_exact input")  # type: ignore[attr-defined]

    def enter_48() -> None:
        box.fill("48")
        box.press("Enter")

    act_until(enter_48, page.get_by_text("max_extend_tokens=48"))  # type: ignore[attr-defined]
    refused = page.get_by_text("max_extend_tokens must be").first  # type: ignore[attr-defined]
    for typed in ("abc", ""):

        def enter(typed: str = typed) -> None:
            box.fill(typed)
            box.press("Enter")

        # an entry lost to a rerun leaves the box at 48 and nothing said (seen on a loaded
        # machine): typed again, as a user would
        act_until(enter, refused)
        expect(box).to_have_value("48")
    expect(page.get_by_text("max_extend_tokens=1,")).to_have_count(0)


def test_the_headline_covers_the_steps_in_view_and_goes_idle(page: object) -> None:
    """The headline's steps are the window's (it was always the newest 200), a new window
    applies while the engine is idle, and once every request ended it says 0 / 0 running and
    waiting and the pool's pages back (it kept the last step's figures)."""
    page.get_by_text("ignore EOS").click()  # type: ignore[attr-defined]
    # the requests must be in first: before any step the headline says 0 / 0 as well
    act_until(
        lambda: submit(page, "Count with me.", 160, copies=2),
        status_line(page, "submitted: request"),
    )
    expect(metric(page, "KV used")).to_contain_text("0.0%", timeout=90_000)  # "–" before a step
    expect(metric(page, "running / waiting")).to_contain_text("0 / 0")
    window = page.locator(".st-key-window input[type='range']")  # type: ignore[attr-defined]
    window.focus()
    window.press("Home")  # 100 steps in view, with the engine idle
    expect(page.get_by_text(re.compile(r"over the 100 steps in view"))).to_be_visible()
    # paused, the charts stay drawn (they used to shrink to 32 px), frozen for zoom and hover
    page.get_by_text("Live", exact=True).click()  # type: ignore[attr-defined]
    expect(page.get_by_text("Paused: the charts are frozen")).to_be_visible()
    page.wait_for_function(  # type: ignore[attr-defined]
        f"() => {{ const g = document.querySelector('{TIMELINE}');"
        " return g && g.getBoundingClientRect().height > 200 && g._fullLayout; }"
    )
    shot(page, "paused.png")


def test_a_retracted_request_is_shown_stalled(page: object) -> None:
    """Under optimistic admission a request retracted for want of pages waits with its tokens
    kept: the headline's worst stall names it while it waits (it said "none")."""
    page.get_by_text("optimistic (SGLang's)").click()  # type: ignore[attr-defined]
    expect(page.get_by_text("admission=optimistic")).to_be_visible()
    page.get_by_text("ignore EOS").click()  # type: ignore[attr-defined]
    # eight copies on 600 pages: from about step 80 on, some request is always retracted and
    # waiting for pages, for seconds, so the page cannot miss it between two updates
    submit(page, "Tell me a long story about the sea.", 300, copies=8)
    stalled = metric(page, "worst stall")
    expect(stalled).to_contain_text("stalled now", timeout=90_000)
    expect(stalled).not_to_contain_text("none")
    page.get_by_text("reserve (the chapter's)").click()  # type: ignore[attr-defined]


def test_the_replay_scrubber_follows_playback(page: object, served: dict) -> None:
    """Playing at 50× from the first step, the slider and its caption move with the charts (the
    slider stayed put); Pause pauses where it is (it restarted from the first step)."""
    box = page.locator(".st-key-replay_path input")  # type: ignore[attr-defined]

    caption = page.get_by_text(re.compile(r"Replay of `?run\.jsonl`?: step \d+"))  # type: ignore[attr-defined]
    act_until(lambda: enter_text(box, str(served["trace"])), caption)
    thumb = page.locator(".st-key-replay_step input[type='range']")  # type: ignore[attr-defined]
    first = int(thumb.get_attribute("min") or 0)

    def to_first() -> None:  # from the end each time: Home on a slider at its start does nothing
        thumb.focus()
        thumb.press("End")
        thumb.press("Home")

    act_until(to_first, page.get_by_text(re.compile(rf": step {first} of")))  # type: ignore[attr-defined]
    speed = page.locator(".st-key-replay_speed input[type='range']")  # type: ignore[attr-defined]
    speed.focus()
    speed.press("Home")
    # 2×: twenty steps pass in moments, and the end of the record (seconds of work, and the
    # idle gaps between the tests) is far off, so the Pause below is never the Play of a
    # replay that has just ended
    speed.press("ArrowRight")
    expect(page.locator(".st-key-replay_speed")).to_contain_text("2×")  # type: ignore[attr-defined]
    page.get_by_role("button", name="Play").click()  # type: ignore[attr-defined]
    # the caption's step and the slider's agree, while playing, well past the first step
    page.wait_for_function(  # type: ignore[attr-defined]
        """(first) => {
            const t = document.querySelector(".st-key-replay_step input[type='range']");
            const m = document.body.innerText.match(/: step (\\d+) of [^\\n]* · playing/);
            return t && m && Number(m[1]) > first + 20 && Number(t.value) === Number(m[1]);
        }""",
        arg=first,
    )
    page.get_by_role("button", name="Pause").click()  # type: ignore[attr-defined]
    expect(page.get_by_text(re.compile(r"· paused ·"))).to_be_visible()
    shown = int(thumb.input_value())
    expect(page.get_by_text(re.compile(rf": step {shown} of"))).to_be_visible()
    assert shown > first + 20  # the slider went with the replay, not back to the first step
    if SHOTS:  # the picture: at 50×, from the first step
        thumb.focus()
        thumb.press("Home")
        speed.focus()
        speed.press("End")
        page.get_by_role("button", name="Play").click()  # type: ignore[attr-defined]
        # a moment well into the run when a redraw has reached the caption and the headline too
        # (Streamlit draws a rerun's elements top to bottom: the slider is ahead for a moment)
        page.wait_for_function(  # type: ignore[attr-defined]
            """() => {
                const t = document.querySelector(".st-key-replay_step input[type='range']");
                const m = document.body.innerText.match(/: step (\\d+) of /);
                const h = document.body.innerText.match(/#(\\d+)\\s/);
                return t && m && h && Number(m[1]) > 100 && Number(t.value) === Number(m[1])
                    && m[1] === h[1];
            }"""
        )
        shot(page, "replay-50x.png")
