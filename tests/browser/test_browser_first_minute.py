"""The first minute, as a new user lives it, in Debian's chromium.

`streamlit run app/main.py` with the auto-start on and nothing at the engine URL: the page starts
the engine itself, on the bundled SmolLM2 as `streamlit run` does (about 5 s to load here; the
tiny random Llama is ready in about 3 s, which a page's first render and two clicks can take on
a loaded machine, so the prompt would not be held at all). While it loads, the user
types a prompt and clicks Submit, and then clicks nothing else. Within a few seconds of the
sidebar's "connected", the page must be whole: the `max_extend_tokens` slider is there, the notice that the
prompt is held is gone, and the prompt's request runs. The held prompt then runs: its
steps reach the live charts.

STEPSCOPE_FIRST_MINUTE_MODEL=PATH runs it on another model.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.harness import CHROMIUM, free_port, running_app, submit, tab

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium"
    ),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

HELD = "your prompt is held"
# On a quiet machine one full run draws "connected" and the whole page together (0 ms apart).
# Under the suite's load "connected" can come first, from the badge's own fragment, and the
# held prompt's reply and one or two full runs of the page follow: 2.2 s seen. The bound tells
# a page that redraws itself from one that waits for a click or a slow timer.
WHOLE_WITHIN_MS = 5_000

# Watches the page every 50 ms and notes when the held notice first shows, when the sidebar first
# says "connected" and when the page is first whole (the budget slider drawn and the held notice
# gone); all in page time. The notice is watched here, not awaited after the click: an engine
# that comes up a moment after the submit replaces it within about a second, between two of
# Playwright's polls.
WATCH_JS = """(held) => {
    const fm = window.__firstMinute = {held: null, connected: null, whole: null};
    const sidebar = () => document.querySelector('[data-testid="stSidebar"]');
    const connected = () => [...(sidebar() || document).querySelectorAll('strong')]
        .some(e => e.textContent.trim() === 'connected');
    const slider = () => {
        const el = document.querySelector('.st-key-budget_slider');
        return !!el && el.offsetParent !== null;
    };
    const timer = setInterval(() => {
        const now = performance.now();
        if (fm.held === null && document.body.innerText.includes(held)) fm.held = now;
        if (fm.connected === null && connected()) fm.connected = now;
        if (fm.connected !== null && fm.whole === null && slider()
                && !document.body.innerText.includes(held)) fm.whole = now;
        if (fm.whole !== null) clearInterval(timer);
    }, 50);
}"""


@contextlib.contextmanager
def port_taken(port: int) -> Iterator[None]:
    """Hold `port` on loopback, as a vLLM or a second page would (if something already holds
    it, that is the case tested too)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            pass  # taken already
        yield


def test_the_first_minute_needs_no_click_after_submit(smollm2_dir: Path) -> None:
    # one torch thread, as every engine the tests start: on a busy 2-core machine a second
    # thread's spinning slowed the engine's load and steps (tests/conftest.py). No HTTP port is
    # given, and 8000 (vLLM's, and the OpenAI API's usual one) is taken: the engine the page
    # starts for itself must come up all the same
    engine_args = "--device cpu --max-extend-tokens 32 --threads 1"
    env = {
        "STEPSCOPE_AUTOSTART": "1",
        "STEPSCOPE_MODEL": os.environ.get("STEPSCOPE_FIRST_MINUTE_MODEL") or "smollm2",
        "STEPSCOPE_ENGINE_ARGS": engine_args,
    }
    expect = sync_api.expect
    with (
        port_taken(8000),
        running_app(f"ws://127.0.0.1:{free_port()}", **env) as app,
        tab(None, timeout_ms=120_000) as page,
    ):
        page.goto(app)
        # the page started the engine, which is loading: the user types and submits now
        expect(page.get_by_text("Starting the engine")).to_be_visible()
        expect(page.get_by_text("the scheduling controls appear once")).to_be_visible()
        page.evaluate(WATCH_JS, HELD)
        page.get_by_text("ignore EOS").click()  # a random model may stop early otherwise
        submit(page, "The first minute of a new user. " * 4, 12)
        held = page.get_by_test_id("stAlertContentSuccess").get_by_text(HELD)
        page.wait_for_function("() => window.__firstMinute.held !== null")
        # (the workload line also says "held until the engine is connected" while it waits:
        # gone at once when the engine comes up meanwhile, so not waited for)

        # no click from here on
        page.wait_for_function("() => window.__firstMinute.whole !== null", timeout=60_000)
        times = page.evaluate("() => window.__firstMinute")
        late_ms = times["whole"] - times["connected"]
        print(f"first minute: the page was whole {late_ms:.0f} ms after 'connected'")
        assert late_ms <= WHOLE_WITHIN_MS, (
            f"the slider and the sent prompt showed {late_ms:.0f} ms after 'connected'"
        )
        expect(page.locator(".st-key-budget_slider")).to_be_visible()
        expect(held).to_have_count(0)
        expect(page.get_by_text("the scheduling controls appear once")).to_have_count(0)
        # the held prompt became a request, and the page says so
        ok = page.get_by_test_id("stAlertContentSuccess")
        expect(ok.get_by_text("submitted: request 0")).to_be_visible()
        expect(page.get_by_text("requests 0")).to_be_visible()
        page.wait_for_function(
            "() => { const r = document.querySelector('.stepscope-live'); "
            "return r && Number(r.dataset.steps) > 3; }"
        )
        assert page.get_by_test_id("stAlertContentError").count() == 0
