"""Two recordings side by side: charts on aligned axes, one above the other, and a table of
their headline figures with the difference. Pure: recordings in, chart data and rows out.

Each run is drawn from its own start (its first step at time 0 and step 0), and both charts get
the same x range and batch height (`axes`), so the same place on the page is the same moment of
each run. The charts are the page's own (the app.live component, fed each run whole through
`record`); the numbers are the shared fold's summary (`instrumentation.fold.summarize`), the
same as the sweep's `summary.csv`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.live.feed import Recorded
from app.replay import Recording, ReplaySource
from app.state import Message, Snapshot
from instrumentation.fold import Summary, summarize

REQUEST_TIMES = ("t_queued", "t_admitted", "t_first_token", "t_last_token", "t_finished")
# (label, Summary field) in table order: the page headline's figures, over each whole recording
METRICS: tuple[tuple[str, str], ...] = (
    ("TTFT p50 (s)", "ttft_p50_s"),
    ("TTFT p99 (s)", "ttft_p99_s"),
    ("ITL p50 (s)", "itl_p50_s"),
    ("ITL p99 (s)", "itl_p99_s"),
    ("ITL p99.9 (s)", "itl_p999_s"),
    ("worst stall (s)", "worst_stall_s"),
    ("output tokens / s", "output_tok_s"),
    ("requests", "requests"),
)


@dataclass(frozen=True)
class Side:
    """One recording folded to its end and rebased to start at 0."""

    name: str
    steps: list[Message]
    requests: list[Message]
    summary: Summary
    policy: str | None
    budget: int | None
    engine: dict[str, Any] | None
    config: dict[str, Any] | None


def folded(recording: Recording) -> Snapshot:
    """The whole recording folded through the page's store (the same fold as live)."""
    source = ReplaySource(recording, threaded=False)
    source.seek_end()
    return source.store.snapshot()


def rebase(steps: Sequence[Message], requests: Sequence[Message]) -> tuple[list, list]:
    """Copies with the first step at time 0 and numbered 0."""
    if not steps:
        return list(steps), list(requests)
    t_base, n_base = float(steps[0]["t0"]), int(steps[0]["step"])
    out_steps = [
        {**s, "t0": s["t0"] - t_base, "t1": s["t1"] - t_base, "step": s["step"] - n_base}
        for s in steps
    ]
    out_reqs = []
    for r in requests:
        r = dict(r)
        for k in REQUEST_TIMES:
            if isinstance(r.get(k), int | float):
                r[k] = r[k] - t_base
        out_reqs.append(r)
    return out_steps, out_reqs


def side(recording: Recording) -> Side:
    snap = folded(recording)
    steps, requests = rebase(snap.steps, snap.requests)
    config = snap.config or {}
    budget = steps[0].get("budget") if steps else config.get("max_extend_tokens")
    policy = steps[0].get("policy") if steps else config.get("policy")
    summary = summarize(recording.messages)
    return Side(recording.name, steps, requests, summary, policy, budget, snap.engine, config)


XMODES = ("step", "time")


def _x_extent(s: Side, x: str) -> tuple[float, float]:
    if not s.steps:
        return (0.0, 1.0)
    if x == "time":
        return (float(s.steps[0]["t0"]), float(s.steps[-1]["t1"]))
    return (float(s.steps[0]["step"]) - 0.5, float(s.steps[-1]["step"]) + 0.5)


def axes(a: Side, b: Side) -> dict[str, dict[str, Any]]:
    """Per x mode, the x range that holds both runs and the batch chart's height (the tallest
    bar of either), so both are drawn to one scale."""
    top = max(_batch_peak(a), _batch_peak(b))
    out = {}
    for x in XMODES:
        lo = min(_x_extent(a, x)[0], _x_extent(b, x)[0])
        hi = max(_x_extent(a, x)[1], _x_extent(b, x)[1])
        out[x] = {"x": [lo, hi], "y_top": top}
    return out


def title(label: str, s: Side) -> str:
    what = ", ".join(p for p in (s.policy, None if s.budget is None else f"budget {s.budget}") if p)
    return f"{label}: {s.name}" + (f" ({what})" if what else "")


def record(s: Side) -> Recorded:
    """The run rebased, as the charts' feed reads a store: every step and request at once."""
    return Recorded(s.steps, s.requests, s.engine, s.config)


def _batch_peak(s: Side) -> float:
    return batch_peak(s.steps)


def batch_peak(steps: Sequence[Message]) -> float:
    """The tallest bar of the batch chart: a step's tokens, or its budget line."""
    peak = 0.0
    for step in steps:
        tokens = sum(int(i["end"]) - int(i["start"]) for i in step.get("items") or ())
        peak = max(peak, tokens, float(step.get("budget") or 0))
    return peak


def table(a: Side, b: Side) -> list[dict[str, Any]]:
    """One row per headline figure: A, B, B − A and B / A (None where either is missing)."""
    rows = []
    for label, name in METRICS:
        va, vb = getattr(a.summary, name), getattr(b.summary, name)
        diff = vb - va if va is not None and vb is not None else None
        ratio = vb / va if va and vb is not None else None
        rows.append({"metric": label, "A": va, "B": vb, "B − A": diff, "B / A": ratio})
    return rows
