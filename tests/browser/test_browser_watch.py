"""The page in a real browser, watching an external engine.

Starts `python -m instrumentation.watch vllm-log` on the recorded vLLM 0.32 CPU run
(tests/fixtures/watch/vllm_0.32_cpu_capture: its log and its raw KV-event frames) and
`streamlit run app/main.py` on it, then checks that every step of the log is drawn with vLLM's
own counts and KV usage, in the engine's lane, that the KV events are drawn (blocks held, the
hit rate from the reuse vLLM announced), that the page says the times are estimated and that
there are no per-request lanes, and that submit, budget, policy and workload controls are
unavailable with the watch's reason. One browser run, for CI's time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.harness import CHROMIUM, ROOT, running_app, stop_process, tab

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium"
    ),
]


@contextlib.contextmanager
def running_watch(*args: str) -> Iterator[str]:
    """`python -m instrumentation.watch ... --port 0`; yields the URL from its stderr line."""
    argv = [sys.executable, "-m", "instrumentation.watch", *args, "--port", "0"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:
            if "watch: serving ws://" in line:
                url = line[line.index("ws://") :].strip()
                break
        assert url, "the watch exited before serving"
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        yield url
    finally:
        stop_process(proc)


# ---- a recorded vLLM 0.32 CPU run: steps, KV usage, KV events ----

CAPTURE = ROOT / "tests" / "fixtures" / "watch" / "vllm_0.32_cpu_capture"
TRACE_Y_JS = """(name) => {
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
        const t = (gd.data || []).find(t => t.name === name);
        if (t) return Array.from(t.y, v => v === null ? null : Number(v));
    }
    return null;
}"""
LANE_BARS_JS = """() => {
    let n = 0;
    for (const gd of document.querySelectorAll('.js-plotly-plot'))
        for (const t of gd.data || [])
            if (t.orientation === 'h') n += t.x.length;
    return n;
}"""
CAPTURE_ARGS = (
    "vllm-log", str(CAPTURE / "vllm.log"), "--kv-events", str(CAPTURE / "kv_events.frames"),
    "--log-timezone", "UTC",
)  # fmt: skip


def capture_messages(tmp_path: Path) -> list[dict]:
    out = tmp_path / "capture.jsonl"
    subprocess.run(
        [sys.executable, "-m", "instrumentation.watch", *CAPTURE_ARGS, "--trace", str(out)],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_page_draws_a_recorded_vllm_run_with_its_kv_and_kv_events(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    pytest.importorskip("msgpack")
    expect = sync_api.expect
    messages = capture_messages(tmp_path)
    steps = [m for m in messages if m["type"] == "step"]
    kv = [m for m in messages if m["type"] == "kv_events"]
    assert len(steps) > 10 and kv

    with (
        running_watch(*CAPTURE_ARGS) as ws_url,
        running_app(ws_url) as page_url,
        tab(page_url, width=1500, height=2200) as page,
    ):
        expect(page.get_by_text("connected", exact=True)).to_be_visible()
        expect(page.get_by_text("vllm-log").first).to_be_visible()

        # Its steps: one bar per iteration line with vLLM's own counts, and the KV usage
        # vLLM printed on every line.
        page.wait_for_function(
            f"() => (({TRACE_Y_JS})('prompt tokens computed') || []).length >= {len(steps)}"
        )
        assert page.evaluate(TRACE_Y_JS, "prompt tokens computed") == [
            s["prompt_tokens"] for s in steps
        ]
        assert page.evaluate(TRACE_Y_JS, "KV usage %") == pytest.approx(
            [100 * s["kv"]["usage"] for s in steps]
        )
        assert page.evaluate(LANE_BARS_JS) == len(steps)  # the engine's lane
        expect(page.get_by_text("Step times are estimated").first).to_be_visible()
        expect(page.get_by_text("No per-request lanes").first).to_be_visible()

        # The controls that would command the engine are unavailable, and the page says why.
        reason = "cannot submit, abort or change its configuration"
        for what in ("Submitting prompts:", "Budget and policy:", "Workloads:"):
            expect(page.get_by_text(what).first).to_be_visible()
        assert page.get_by_text(reason).count() >= 3
        expect(page.get_by_role("button", name="Submit")).to_have_count(0)
        expect(page.locator(".st-key-budget_slider")).to_have_count(0)
        expect(page.locator("[class*='st-key-preset-'] button").first).to_be_disabled()

        # Its KV events: blocks held after each batch, and the hit rate from the reuse
        # vLLM announced when the long prompt came again.
        expect(page.get_by_text("Prefix cache (KV events)")).to_be_visible()
        page.wait_for_function(f"() => (({TRACE_Y_JS})('blocks held') || []).length >= {len(kv)}")
        assert page.evaluate(TRACE_Y_JS, "blocks held") == [m["blocks"] for m in kv]
        rates = page.evaluate(TRACE_Y_JS, "prefix-cache hit rate (blocks)")
        assert rates[-1] == pytest.approx(
            100
            * sum(m["reused_blocks"] for m in kv)
            / sum(m["reused_blocks"] + m["stored_blocks"] for m in kv)
        )

        shot = tmp_path / "watch-vllm-capture.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("STEPSCOPE_SCREENSHOTS")  # docs: assets/watch-vllm-capture.png
        if keep:
            shutil.copy(shot, Path(keep) / shot.name)
