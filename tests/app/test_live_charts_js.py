"""The charts' figures (app/live/static/*.js) run in Node on batches the feed made, without a
browser or Plotly: what each figure draws, as data. The zoom, the pulls and the DOM are the
browser tests' (tests/browser/test_browser_charts.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.live.component import style
from app.live.feed import LiveFeed, ViewOptions
from tests.app.test_app_live import Engine

STATIC = Path(__file__).resolve().parents[2] / "app" / "live" / "static"
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")

# The figures of one batch: data.js, timeline.js and progress.js as the page loads them.
FIGURES_JS = """
globalThis.window = globalThis;
for (const f of ["data.js", "timeline.js", "progress.js"]) require(process.argv[1] + "/" + f);
const S = window.stepscope, input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const rec = new S.Record();
rec.apply(input.batch, 1e9);
const tl = S.timelineFigure(rec, new S.Axis(rec, "step"), input.style, null, 1200, null);
const pr = S.progressFigure(rec, input.style, 1200);
const named = (fig, prefix) => fig.data.filter((t) => (t.name || "").startsWith(prefix));
console.log(JSON.stringify({
  lanes: tl.lanes,
  timelineNotes: tl.layout.annotations.map((a) => a.text),
  lines: named(pr, "req ").map((t) => ({ name: t.name, last: t.y[t.y.length - 1], color: t.line.color })),
  total: named(pr, "all requests").map((t) => t.y[t.y.length - 1]),
  progressNotes: (pr.layout.annotations || []).map((a) => a.text),
  colors: input.uids.map((u) => S.color(input.style, u)),
}));
"""


def _figures(requests: int, steps: int = 12, uids: list[int] | None = None) -> dict[str, Any]:
    eng = Engine()
    eng.steps(steps, uids=tuple(range(requests)))
    batch = LiveFeed().payload(eng.store, None, ViewOptions(window=500, xmode="step"))
    batch.pop("config", None)
    data = {"batch": batch, "style": style(), "uids": uids or []}
    done = subprocess.run(
        ["node", "-e", FIGURES_JS, str(STATIC)],
        input=json.dumps(data),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def test_decode_progress_draws_a_line_per_request_with_the_total() -> None:
    out = _figures(requests=3, steps=12)
    assert sorted(line["name"] for line in out["lines"]) == ["req 0", "req 1", "req 2"]
    assert all(line["last"] == 12 for line in out["lines"])  # one token a step each
    assert out["total"] == [36]  # the total is still drawn, over them
    assert {line["color"] for line in out["lines"]} == set(style()["palette"][:3])
    assert out["progressNotes"] == []


def test_decode_progress_says_when_there_are_too_many_requests_for_a_line_each() -> None:
    out = _figures(requests=64, steps=3)
    assert out["lines"] == [] and out["total"] == [192]
    assert out["progressNotes"] and "64 requests in view" in out["progressNotes"][0]


def test_the_timeline_says_how_many_requests_have_no_lane() -> None:
    out = _figures(requests=64, steps=3)
    assert out["lanes"] == [style()["max_lanes"], 64]
    notes = [n for n in out["timelineNotes"] if "Lanes of the newest" in n]
    assert notes and "40 of the 64" in notes[0] and "24 older" in notes[0]
    few = _figures(requests=5, steps=3)
    assert few["lanes"] == [5, 5] and not any("Lanes of" in n for n in few["timelineNotes"])


def test_the_browser_colours_a_request_as_python_does() -> None:
    from app.live.style import request_color

    uids = [0, 11, 83, -1, 12345]
    out = _figures(requests=1, steps=1, uids=uids)
    assert out["colors"] == [request_color(u) for u in uids]
