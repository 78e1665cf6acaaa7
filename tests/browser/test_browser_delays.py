"""The named delay in Debian's chromium: the stall workload ("Long prompt vs. chatting
requests": four chats decode, then a long prompt arrives) under prefill-first on the tiny random
Llama; the mouse on a chat's red stall in its timeline lane shows what it waited for, naming the
long prompt's request and its chunks, and the headline names the worst stall's main cause.

With STEPSCOPE_SCREENSHOTS=DIR the test also saves the Delays tab after the workload, under
prefill-first and under mixed: DIR/delays-prefill-first.png and DIR/delays-mixed.png.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.harness import CHROMIUM, act_until, running_app, running_engine, status_line, tab

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium"
    ),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
expect = sync_api.expect
TIMEOUT_MS = 90_000
SHOTS = os.environ.get("STEPSCOPE_SCREENSHOTS")  # a folder for the Delays tab's pictures
STALL_PRESET = "Long prompt vs. chatting requests"
# the workload's long prompt (about 1,500 tokens) is longer than the tiny model's context
FLAGS = ("--max-extend-tokens", "64", "--policy", "prefill_first", "--max-running-req", "8",
         "--max-seq-len", "2048", "--threads", "1", "--http-port", "none")  # fmt: skip

# The middle of a red stall segment whose causes (they come largest first: "it waited 38 ms:<br>·
# 31 ms request 9's prompt [512:768] in steps 812–814<br>· 7 ms own decode ...") include request
# `uid`'s prompt, the largest if any stall has it so: its place on the screen, its lane, and the
# text the page put in it. A chat's gap may also hold another chat's prompt, larger there than
# the long prompt's chunk; and on a loaded machine the time between steps can outweigh the tiny
# model's chunks in every gap (seen: "277 ms — mostly time between steps").
STALL_JS = """(uid) => {
    const gd = document.querySelector('.stepscope-live .sl-timeline');
    if (!gd || !gd._fullLayout || !gd.data) return null;
    const t = gd.data.find((t) => t.name === 'stall (no token this step)');
    if (!t || !t.customdata) return null;
    const first = new RegExp(`it waited [^:]*:<br>· [0-9.]+ m?s request ${uid}'s prompt `);
    const any = new RegExp(`<br>· [0-9.]+ m?s request ${uid}'s prompt `);
    let k = t.customdata.findIndex((c) => first.test(String(c)));
    if (k < 0) k = t.customdata.findIndex((c) => any.test(String(c)));
    if (k < 0) return null;
    const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis2, box = gd.getBoundingClientRect();
    return { x: box.left + xa._offset + xa.l2p(t.base[k] + t.x[k] / 2),
             y: box.top + ya._offset + ya.d2p(t.y[k]), lane: t.y[k], text: t.customdata[k] };
}"""


@pytest.fixture(scope="module")
def page(tiny_llama_dir: Path) -> Iterator[object]:
    """One engine, one page server and one tab for the module."""
    with (
        running_engine(tiny_llama_dir, *FLAGS) as engine,
        running_app(engine) as app,
        tab(app, timeout_ms=TIMEOUT_MS) as page,
    ):
        expect(page.get_by_text("connected", exact=True)).to_be_visible()
        yield page


def run_stall_workload(page: object) -> list[int]:
    """Clear the record, run the stall workload to its end; its requests' uids (the long
    prompt last)."""
    page.get_by_role("button", name="Clear history").click()  # type: ignore[attr-defined]
    expect(page.get_by_text("history cleared")).to_be_visible()  # type: ignore[attr-defined]
    page.get_by_role("button", name=STALL_PRESET).click()  # type: ignore[attr-defined]
    expect(status_line(page, f"workload “{STALL_PRESET}” started")).to_be_visible()
    line = re.compile(STALL_PRESET + r": 6/6 steps sent · requests [\d, ]+")
    done = page.get_by_text(line).last  # type: ignore[attr-defined]  # the newest run's line
    expect(done).to_be_visible()
    uids = [int(u) for u in re.findall(r"\d+", done.inner_text().split("· requests")[1])]
    running = page.locator("[data-testid='stMetric']", has_text="running / waiting")  # type: ignore[attr-defined]
    expect(running).to_contain_text("0 / 0")  # every request ended: nothing redraws the lanes
    return uids


def delays_shot(page: object, name: str) -> None:
    """The Delays tab, drawn, saved as DIR/name."""
    page.get_by_role("tab", name="Delays").click()  # type: ignore[attr-defined]
    panel = page.get_by_role("tabpanel", name="Delays")  # type: ignore[attr-defined]
    expect(panel.get_by_text("Who delayed whom")).to_be_visible()
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => [...document.querySelectorAll('[role=tabpanel] .js-plotly-plot')]"
        ".filter((g) => g._fullLayout).length >= 2"
    )
    page.mouse.move(0, 0)  # type: ignore[attr-defined]  # no hover label, no mode bar
    page.wait_for_timeout(500)  # type: ignore[attr-defined]
    panel.screenshot(path=str(Path(SHOTS) / name))  # type: ignore[arg-type]


def test_a_stalled_gap_names_what_it_waited_for(page: object) -> None:
    uids = run_stall_workload(page)
    long = uids[-1]
    page.locator(".stepscope-live .sl-timeline").scroll_into_view_if_needed()  # type: ignore[attr-defined]
    page.wait_for_function(f"(uid) => ({STALL_JS})(uid) !== null", arg=long)  # type: ignore[attr-defined]
    stall = page.evaluate(STALL_JS, long)  # type: ignore[attr-defined]
    # the mouse on it: Plotly's hover label says what the chat waited for
    page.mouse.move(stall["x"], stall["y"])  # type: ignore[attr-defined]
    label = page.locator(".stepscope-live .sl-timeline .hoverlayer .hovertext")  # type: ignore[attr-defined]
    expect(label.first).to_contain_text(f"request {long}'s prompt")
    text = label.first.text_content()
    assert stall["lane"] != f"req {long}" and text.startswith(f"{stall['lane']} · stall: ")
    # among its causes, the long prompt's chunks, by token range and steps
    assert re.search(r"it waited [\d.]+ m?s:·", text), text
    causes = re.search(
        rf"· [\d.]+ m?s request {long}'s prompt \[(\d+):(\d+)\] in steps? [\d–]+", text
    )
    assert causes is not None and int(causes[1]) < int(causes[2]), text
    # and the causes the label lists come largest first
    shown = [float(v) * (1e-3 if unit == "ms" else 1.0)
             for v, unit in re.findall(r"· ([\d.]+) (m?s) ", text)]  # fmt: skip
    assert shown == sorted(shown, reverse=True), text
    # the headline names the worst stall's main cause, and whose stall it was: which cause is
    # the machine's timing (a prompt's chunks or, on a loaded machine, a decode step that ran
    # long, or the time between steps)
    headline = page.get_by_text(re.compile(r"Worst stall: [\d.]+ m?s — .+ \(request \d+"))  # type: ignore[attr-defined]
    expect(headline).to_be_visible()
    named = re.search(r"Worst stall: [\d.]+ m?s — (.+) \(request (\d+)", headline.inner_text())
    assert named is not None and int(named[2]) in uids and named[1]
    if SHOTS:
        delays_shot(page, "delays-prefill-first.png")
        page.get_by_text("mixed (stall-free)").click()  # type: ignore[attr-defined]
        act_until(lambda: None, status_line(page, "policy=mixed"))
        run_stall_workload(page)
        delays_shot(page, "delays-mixed.png")
