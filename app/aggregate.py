"""Steps that carry counts, not request ids: an external engine watched through
`python -m instrumentation.watch` (SGLang or vLLM logs, forward-pass metrics).

Such a step has `source`, `items: []` and aggregate fields, each possibly absent
(`prompt_tokens`, `cached_tokens`, `decode_requests`, `decode_tokens`, `queue`, `budget`,
`kv.usage`, `gen_throughput`, `sample_of_steps`). `aggregate_step` reads them (None where absent:
a gap, never a zero or an estimate); the live charts send them to the browser
(app/live/encode.py), which draws them (app/live/static/aggregate.js), a decode line that
summarises N steps as a sample of N steps, not as one step. The prefix cache's KV events (vLLM)
are drawn here (`kv_events_figure`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from app.derive import Headline

Message = dict[str, Any]

NO_LANES_CAPTION = (
    "No per-request lanes: this source carries counts, not request ids. Bars are each step's "
    "aggregate work as the engine logged it: prompt tokens computed (hatched) and decode tokens "
    "(or decode requests, where the log counts requests); ○ marks prompt tokens served from the "
    "prefix cache (not computed); ◆ marks a sample: one log line that summarises N steps."
)


def is_aggregate(step: Message) -> bool:
    """A step from an external source: counts, no per-request items."""
    return bool(step.get("source")) and not step.get("items")


def any_aggregate(steps: Sequence[Message]) -> bool:
    return any(is_aggregate(s) for s in steps)


@dataclass(frozen=True)
class AggregateStep:
    """What one aggregate step says; None where the source did not say it."""

    step: int
    t1: float
    phase: str
    prompt_tokens: int | None
    cached_tokens: int | None
    decode_tokens: int | None
    decode_requests: int | None
    waiting: int | None
    running: int | None
    kv_usage: float | None
    budget: int | None
    gen_throughput: float | None
    sample_of_steps: int | None

    @property
    def decode_bar(self) -> tuple[int | None, str]:
        """The decode bar's height and what it counts: tokens when the source says them, else
        running decode requests (SGLang's decode lines give requests, not tokens)."""
        if self.decode_tokens is not None:
            return self.decode_tokens, "decode tokens"
        return self.decode_requests, "decode requests"


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def aggregate_step(s: Message) -> AggregateStep:
    queue = s.get("queue") or {}
    kv = s.get("kv") or {}
    usage = kv.get("usage")
    if usage is None and kv.get("used") is not None and kv.get("total"):
        usage = kv["used"] / kv["total"]
    throughput = s.get("gen_throughput")
    return AggregateStep(
        step=int(s["step"]),
        t1=float(s["t1"]),
        phase=str(s.get("phase", "?")),
        prompt_tokens=_int(s.get("prompt_tokens")),
        cached_tokens=_int(s.get("cached_tokens")),
        decode_tokens=_int(s.get("decode_tokens")),
        decode_requests=_int(s.get("decode_requests")),
        waiting=_int(queue.get("waiting")),
        running=_int(queue.get("running")),
        kv_usage=None if usage is None else float(usage),
        budget=_int(s.get("budget")),
        gen_throughput=None if throughput is None else float(throughput),
        sample_of_steps=_int(s.get("sample_of_steps")),
    )


def _bar(name: str, xs: list, ys: list, hover: list[str], marker: dict, yaxis: str) -> dict:
    return {
        "type": "bar",
        "name": name,
        "x": xs,
        "y": ys,
        "yaxis": yaxis,
        "marker": {"line": {"width": 0}, **marker},
        "hovertext": hover,
        "hoverinfo": "text",
    }


def _line(name: str, xs: list, ys: list, hover: list[str], color: str, yaxis: str) -> dict:
    return {
        "type": "scatter",
        "mode": "lines+markers",
        "name": name,
        "x": xs,
        "y": ys,
        "yaxis": yaxis,
        "connectgaps": False,
        "line": {"color": color, "shape": "hv", "width": 1.5},
        "marker": {"size": 4, "color": color},
        "hovertext": hover,
        "hoverinfo": "text",
    }


def headline(steps: Sequence[Message], base: Headline) -> Headline:
    """The metric row for aggregate steps: the engine's own logged throughput and KV usage;
    stalls and per-request latencies are unknown (no request ids), not zero."""
    rows = [aggregate_step(s) for s in steps]
    tps = next((r.gen_throughput for r in reversed(rows) if r.gen_throughput is not None), None)
    usage = next((r.kv_usage for r in reversed(rows) if r.kv_usage is not None), None)
    return replace(
        base,
        tokens_per_s=tps,
        kv_used=usage,
        kv_cached=None,
        worst_stall=None,
        worst_stall_uid=None,
    )


KV_EVENTS_CAPTION = (
    "The engine's prefix cache as its KV events report it (vLLM `--kv-events-config`): blocks "
    "held (stored and not yet removed) after each batch of events, with each batch's stored (up) "
    "and removed (down) blocks; ✕ marks a clear of the whole cache. A held block may be in use by "
    "a request or only cached: the events do not say which."
)


def _step_at(times: list[float], steps: list[int], t: float) -> int:
    """The last step that ended at or before `t` (the step the batch of events followed); the
    first step for a batch received before any."""
    i = bisect.bisect_right(times, t) - 1
    return steps[max(i, 0)]


def kv_events_figure(
    kv_events: Sequence[Message], steps: Sequence[Message] = (), x: str = "step"
) -> Any:
    """Blocks held by the watched engine's prefix cache over time, from `kv_events` messages.
    In step mode each batch sits at the last step that ended before it was received (the
    aggregate figure's axis); with no steps, or in time mode, at its receive time."""
    events = [m for m in kv_events if m.get("type", "kv_events") == "kv_events"]
    by_step = x != "time" and bool(steps)
    if by_step:
        ordered = sorted((float(s.get("t1", 0.0)), int(s["step"])) for s in steps)
        times, numbers = [t for t, _ in ordered], [n for _, n in ordered]
        xs: list[Any] = [_step_at(times, numbers, float(m.get("t", 0.0))) for m in events]
    else:
        xs = [float(m.get("t", 0.0)) for m in events]
    hover = [
        f"{m.get('blocks', 0):,} blocks held ({m.get('tokens', 0):,} tokens)<br>"
        f"+{m.get('stored_blocks', 0)} stored, −{m.get('removed_blocks', 0)} removed"
        + (" · cache cleared" if m.get("cleared") else "")
        + (f"<br>dp rank {m['dp_rank']}" if m.get("dp_rank") is not None else "")
        for m in events
    ]
    data: list[dict] = [
        _line("blocks held", xs, [m.get("blocks") for m in events], hover, "#4c78a8", "y"),
        _bar(
            "stored",
            xs,
            [m.get("stored_blocks", 0) for m in events],
            hover,
            {"color": "#59a14f"},
            "y2",
        ),  # fmt: skip
        _bar(
            "removed",
            xs,
            [-int(m.get("removed_blocks", 0)) for m in events],
            hover,
            {"color": "#e15759"},
            "y2",
        ),  # fmt: skip
    ]
    cleared = [(xv, m) for xv, m in zip(xs, events, strict=True) if m.get("cleared")]
    if cleared:
        data.append(
            {"type": "scatter", "mode": "markers", "name": "cache cleared", "yaxis": "y",
             "x": [xv for xv, _ in cleared], "y": [m.get("blocks", 0) for _, m in cleared],
             "marker": {"symbol": "x", "size": 10, "color": "#222"}, "hoverinfo": "skip"}
        )  # fmt: skip
    total = next((m["total_blocks"] for m in reversed(events) if m.get("total_blocks")), None)
    if total is not None and xs:
        data.append(
            {"type": "scatter", "mode": "lines", "name": f"pool ({total:,} blocks)", "yaxis": "y",
             "x": [min(xs), max(xs)],
             "y": [total, total], "line": {"color": "#888", "dash": "dash", "width": 1},
             "hoverinfo": "skip"}
        )  # fmt: skip
    block = next((m["block_size"] for m in reversed(events) if m.get("block_size")), None)
    layout: dict[str, Any] = {
        "height": 380,
        "barmode": "relative",
        "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "xanchor": "left"},
        "hovermode": "closest",
        "uirevision": "stepscope-kv-events",
        "xaxis": {
            "title": {"text": "engine step" if by_step else "time (s)"},
            "anchor": "y2",
        },
        "yaxis": {
            "title": {"text": "blocks held" + (f" ({block} tokens)" if block else "")},
            "domain": [0.38, 1.0],
        },
        "yaxis2": {"title": {"text": "per batch"}, "domain": [0.0, 0.3], "anchor": "x"},
    }
    if not events:
        layout["annotations"] = [
            {"text": "No KV events from the source yet.", "showarrow": False, "xref": "paper",
             "yref": "paper", "x": 0.5, "y": 0.5}
        ]  # fmt: skip
    import plotly.graph_objects as go

    return go.Figure(data=data, layout=layout)
