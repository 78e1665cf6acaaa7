"""The charts' data, on synthetic protocol messages: the headline's derived numbers, a compared
recording's axes and its one batch, and what the browser's chart code (app/live/static, run in
Node) draws from it: the fixed axes of a comparison and the inter-token latency chart's stalls,
which must be the shared fold's (instrumentation.fold.stalls)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app import compare
from app.derive import headline
from app.live.component import style
from instrumentation.fold import stalls as fold_stalls
from instrumentation.fold import summarize

Message = dict[str, Any]
STATIC = Path(__file__).resolve().parents[2] / "app" / "live" / "static"


def step(
    n: int,
    items: list[tuple[int, str, int, int]],
    *,
    budget: int = 16,
    dt: float = 0.1,
    kv: tuple[int, int, int, int, int] = (100, 10, 5, 85, 40),
    phase: str | None = None,
) -> Message:
    kinds = {k == "decode" for _, k, _, _ in items}
    if phase is None:
        phase = "mixed" if len(kinds) == 2 else ("decode" if True in kinds else "prefill")
    total, used, cached, free, reserved = kv
    return {
        "type": "step",
        "step": n,
        "t0": n * dt,
        "t1": (n + 1) * dt,
        "phase": phase,
        "budget": budget,
        "items": [{"uid": u, "kind": k, "start": a, "end": b} for u, k, a, b in items],
        "kv": {"total": total, "used": used, "cached": cached, "free": free, "reserved": reserved},
        "queue": {"waiting": 0, "running": 2},
    }


def request(uid: int, state: str = "finished", t_queued: float = 0.0, **extra: Any) -> Message:
    return {"uid": uid, "state": state, "t_queued": t_queued, **extra}


def chapter_steps() -> list[Message]:
    """The chapter's printed trace: budget 16, prompts of 61, 5 and 5 tokens, max_tokens=3."""
    return [
        step(0, [(0, "chunk", 0, 16)]),
        step(1, [(0, "chunk", 16, 32)]),
        step(2, [(0, "chunk", 32, 48)]),
        step(3, [(0, "prefill", 48, 61), (1, "chunk", 0, 3)]),
        step(4, [(1, "prefill", 3, 5), (2, "prefill", 0, 5)]),
        step(5, [(0, "decode", 61, 62), (1, "decode", 5, 6), (2, "decode", 5, 6)]),
        step(6, [(0, "decode", 62, 63), (1, "decode", 6, 7), (2, "decode", 6, 7)]),
    ]


def stall_steps() -> list[Message]:
    """Request 0 decodes, then request 1's 48-token prompt is chunked for three steps."""
    return [
        step(0, [(0, "prefill", 0, 8)]),
        step(1, [(0, "decode", 8, 9)]),
        step(2, [(1, "chunk", 0, 16)]),
        step(3, [(1, "chunk", 16, 32)]),
        step(4, [(1, "prefill", 32, 48)]),
        step(5, [(0, "decode", 9, 10), (1, "decode", 48, 49)]),
    ]


# ---- derived facts ------------------------------------------------------------------------------


def test_headline_numbers() -> None:
    steps = stall_steps()
    reqs = [
        request(0, t_queued=0.0, t_first_token=0.1),
        request(1, t_queued=0.15, t_first_token=0.5),
    ]
    h = headline(steps, reqs)
    assert h.ttft_p50 == pytest.approx((0.1 + 0.35) / 2)
    assert h.worst_stall == pytest.approx(0.4)
    assert h.worst_stall_uid == 0
    assert h.itl_p50 == pytest.approx(np.percentile([0.1, 0.4, 0.1], 50))
    assert h.kv_used == pytest.approx(0.10) and h.kv_cached == pytest.approx(0.05)
    # 5 tokens sampled (steps 0, 1, 4 and two in 5) over 0.6 s of engine time
    assert h.tokens_per_s == pytest.approx(5 / 0.6)
    # both requests ended: the records say so, whatever the last step's queue saw
    assert (h.running, h.waiting) == (0, 0)


def test_headline_without_stalls_reports_none() -> None:
    steps = chapter_steps()[4:]
    assert headline(steps, []).worst_stall is None


# ---- a compared recording, drawn whole ------------------------------------------------------


def _side(name: str, steps: list[Message], requests: list[Message]) -> compare.Side:
    msgs = [{"type": "hello", "protocol": 1, "now": 0.0, "engine": {}, "config": {},
             "history": {"steps": [], "requests": []}}, *steps]  # fmt: skip
    return compare.Side(name, steps, requests, summarize(msgs), "mixed", 16, {"page_size": 1}, {})


def test_compare_axes_hold_both_runs_and_the_tallest_bar() -> None:
    a = _side("a", stall_steps(), [request(0), request(1)])
    b = _side("b", chapter_steps(), [request(0), request(1), request(2)])
    ax = compare.axes(a, b)
    assert ax["step"]["x"] == [-0.5, 6.5]  # b has 7 steps, a 6
    assert ax["time"]["x"] == [0.0, pytest.approx(0.7)]
    assert ax["step"]["y_top"] == ax["time"]["y_top"] == 16  # the budget line, above every bar
    assert compare.title("A", a) == "A: a (mixed, budget 16)"


def _run_node(script: str, payload: Any) -> Any:
    files = [str(STATIC / name) for name in ("data.js", "timeline.js", "progress.js")]
    prelude = (
        "globalThis.window = globalThis; for (const f of JSON.parse(process.argv[1])) require(f);"
    )
    done = subprocess.run(
        ["node", "-e", prelude + script, json.dumps(files)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


DRAW_JS = """
const {batch, style, axes} = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const S = window.stepscope, rec = new S.Record();
rec.apply(batch, batch.window);
const axis = new S.Axis(rec, 'step');
const tl = S.timelineFigure(rec, axis, style, null, 1200, axes.step);
const itl = S.itlFigure(rec, axis, style, 1200);
const red = itl.data.find((t) => t.name === 'after a stall');
console.log(JSON.stringify({x: tl.layout.xaxis.range, y: tl.layout.yaxis.range,
  red: red.customdata, steps: rec.steps.length}));
"""


def test_a_recording_is_one_batch_the_browser_draws_whole_on_the_fixed_axes() -> None:
    steps = stall_steps()
    requests = [request(0, t_finished=0.6), request(1, t_finished=0.6)]
    side = _side("a", steps, requests)
    batch = compare.record(side).batch("step")
    assert batch["reset"] and batch["steps"]["step"] == [0, 1, 2, 3, 4, 5]
    axes = compare.axes(side, side)
    got = _run_node(DRAW_JS, {"batch": batch, "style": style(), "axes": axes})
    assert got["steps"] == 6
    assert got["x"] == axes["step"]["x"]  # the comparison's range, not the data's own
    assert got["y"][1] == pytest.approx(1.12 * axes["step"]["y_top"])
    # the red points of the latency chart: the token that ended each stall, as the shared fold
    # finds stalls (request 0 left out of steps 2-4, its next token at step 5)
    want = [[s.uid, steps[s.last + 1]["step"]] for s in fold_stalls(steps) if not s.ongoing]
    assert got["red"] == want == [[0, 5]]
