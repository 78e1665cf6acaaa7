"""Figures for steps that carry counts, not request ids: an external engine watched through
`python -m instrumentation.watch` (SGLang or vLLM logs, forward-pass metrics).

Such a step has `source`, `items: []` and aggregate fields, each possibly absent
(`prompt_tokens`, `cached_tokens`, `decode_requests`, `decode_tokens`, `queue`, `budget`,
`kv.usage`, `gen_throughput`, `sample_of_steps`). The figures draw only those fields: a missing
value is a gap, never a zero or an estimate, and a decode line that summarises N steps is drawn
as a sample of N steps, not as one step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import plotly.graph_objects as go

from app.derive import Headline

Message = dict[str, Any]

NO_LANES_CAPTION = (
    "No per-request lanes: this source carries counts, not request ids. Bars are each step's "
    "aggregate work as the engine logged it: prompt tokens computed (hatched) and decode tokens "
    "(or decode requests, where the log counts requests); ○ marks prompt tokens served from the "
    "prefix cache (not computed); ◆ marks a sample: one log line that summarises N steps."
)
PROMPT_COLOR = "#999"
CACHED_COLOR = "#cfcfcf"
DECODE_COLOR = "#555"


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

    def hover(self) -> str:
        parts = [f"step {self.step} · {self.phase}"]
        if self.sample_of_steps and self.sample_of_steps > 1:
            parts.append(f"sample of {self.sample_of_steps} steps")
        for label, value in (
            ("prompt tokens", self.prompt_tokens),
            ("cached tokens", self.cached_tokens),
            ("decode tokens", self.decode_tokens),
            ("decode requests", self.decode_requests),
            ("budget", self.budget),
            ("waiting", self.waiting),
            ("running", self.running),
        ):
            if value is not None:
                parts.append(f"{label} {value:,}")
        if self.kv_usage is not None:
            parts.append(f"KV usage {self.kv_usage:.0%}")
        if self.gen_throughput is not None:
            parts.append(f"{self.gen_throughput:,.1f} gen tokens/s")
        return "<br>".join(parts)


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


def aggregate_figure(steps: Sequence[Message], x: str = "step") -> go.Figure:
    """Batch composition, KV usage, queue and throughput per step, from aggregate fields only."""
    rows = [aggregate_step(s) for s in steps]
    xs = [r.t1 if x == "time" else r.step for r in rows]
    hover = [r.hover() for r in rows]
    decode = [r.decode_bar[0] for r in rows]
    data: list[dict] = [
        _bar("decode", xs, decode, hover, {"color": DECODE_COLOR}, "y"),
        _bar(
            "prompt tokens computed",
            xs,
            [r.prompt_tokens for r in rows],
            hover,
            {
                "color": PROMPT_COLOR,
                "pattern": {"shape": "/", "fillmode": "overlay", "fgcolor": "white"},
            },
            "y",
        ),
    ]
    if any(r.cached_tokens for r in rows):
        # Served from the prefix cache: not computed, so not stacked on the step's work.
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "prompt tokens served from cache (not computed)",
                "x": xs,
                "y": [r.cached_tokens for r in rows],
                "yaxis": "y",
                "marker": {"symbol": "circle-open", "size": 9, "color": "#4c78a8"},
                "hovertext": hover,
                "hoverinfo": "text",
            }
        )
    samples = [(xv, r) for xv, r in zip(xs, rows, strict=True) if (r.sample_of_steps or 0) > 1]
    if samples:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "sample of N steps (one log line)",
                "x": [xv for xv, _ in samples],
                "y": [r.decode_bar[0] or 0 for _, r in samples],
                "yaxis": "y",
                "marker": {"symbol": "diamond", "size": 8, "color": "#222"},
                "hovertext": [
                    f"sample of {r.sample_of_steps} steps<br>{r.hover()}" for _, r in samples
                ],
                "hoverinfo": "text",
            }
        )
    budgets = [r.budget for r in rows]
    if any(b is not None for b in budgets):
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "budget (where logged)",
                "x": xs,
                "y": budgets,
                "yaxis": "y",
                "marker": {"symbol": "line-ew-open", "size": 14, "color": "#222"},
                "hoverinfo": "skip",
            }
        )
    panels = [("y", "tokens / requests")]
    if any(r.kv_usage is not None for r in rows):
        usage = [None if r.kv_usage is None else 100 * r.kv_usage for r in rows]
        data.append(_line("KV usage %", xs, usage, hover, "#4c78a8", "y2"))
        panels.append(("y2", "KV usage %"))
    if any(r.waiting is not None or r.running is not None for r in rows):
        axis = f"y{len(panels) + 1}"
        data.append(_line("waiting", xs, [r.waiting for r in rows], hover, "#ff7f0e", axis))
        data.append(_line("running", xs, [r.running for r in rows], hover, "#2ca02c", axis))
        panels.append((axis, "queue (requests)"))
    if any(r.gen_throughput is not None for r in rows):
        axis = f"y{len(panels) + 1}"
        tps = [r.gen_throughput for r in rows]
        data.append(_line("gen tokens/s (logged)", xs, tps, hover, "#9467bd", axis))
        panels.append((axis, "gen tokens/s"))
    layout: dict[str, Any] = {
        "height": 260 + 140 * len(panels),
        "barmode": "stack",
        "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "xanchor": "left"},
        "hovermode": "closest",
        "uirevision": "stepscope",
        # The shared x axis sits under the bottom panel.
        "xaxis": {
            "title": {"text": "engine time (s)" if x == "time" else "engine step"},
            "anchor": panels[-1][0],
        },
    }
    # Stack the panels top to bottom: the batch gets twice the height of each other panel.
    weights = [2] + [1] * (len(panels) - 1)
    gap, top = 0.04, 1.0
    usable = 1.0 - gap * (len(panels) - 1)
    for (axis, title), w in zip(panels, weights, strict=True):
        h = usable * w / sum(weights)
        name = "yaxis" if axis == "y" else f"yaxis{axis[1:]}"
        layout[name] = {"title": {"text": title}, "domain": [max(0.0, top - h), top]}
        if axis != "y":
            layout[name]["anchor"] = "x"
        top -= h + gap
    if not rows:
        layout["annotations"] = [
            {"text": "No steps from the source yet.", "showarrow": False, "xref": "paper",
             "yref": "paper", "x": 0.5, "y": 0.5}
        ]  # fmt: skip
    return go.Figure(data=data, layout=layout)


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
) -> go.Figure:
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
    return go.Figure(data=data, layout=layout)
