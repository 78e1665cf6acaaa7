"""Plotly figures as pure functions of recorded protocol messages (plain dicts, PROTOCOL.md).

Every builder takes step messages (oldest first) and request records (the `hello.history`
shape) and returns a `go.Figure`; none reads global state, so each is unit-tested on synthetic
events. Figures are assembled from plain dicts with plotly's validation off: validating
40,000-element arrays costs more than half a second per redraw, and the tests validate the
same specs once with it on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from app import aggregate
from app.derive import (
    Message,
    StepAxis,
    Track,
    XMode,
    stalled_per_step,
    stalls,
    step_axis,
    token_gaps,
    tracks,
)

STALL_RED = "#d62728"
# No reds or pinks: red means a stall everywhere on the page.
PALETTE = (
    "#1f77b4",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#17becf",
    "#8c564b",
    "#bcbd22",
    "#393b79",
    "#637939",
    "#e7ba52",
    "#6b6ecf",
    "#7f7f7f",
)
PHASE_COLORS = {"prefill": "#dce9f7", "decode": "#e2f2dc", "mixed": "#efe4f5"}
PHASE_CODES = {"prefill": 0, "decode": 1, "mixed": 2}
KV_COLORS = {"used": "#4c78a8", "cached": "#9ecae9", "free": "#ececec"}
WAIT_GREY = "#c7c7c7"
WASTED_GREY = "#b0b0b0"  # work a step did for a request that ended while it ran
# Past this many steps in view, one request's tokens in one step are thinner than a pixel, so
# the batch chart draws per-step totals by kind instead of per-request segments.
DETAIL_STEPS = 1_500
MAX_REQUEST_TRACES = 40
X_TITLES = {"step": "engine step", "time": "engine time (s)"}


def request_color(uid: int) -> str:
    """Each request keeps this colour in every chart."""
    return PALETTE[uid % len(PALETTE)]


def _figure(data: list[dict[str, Any]], layout: dict[str, Any]) -> go.Figure:
    base = {
        "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "xanchor": "left"},
        "hovermode": "closest",
        # Keeps zoom if the chart is updated in place rather than remounted.
        "uirevision": "stepscope",
    }
    return go.Figure(data=data, layout={**base, **layout}, _validate=False)


def empty_figure(message: str, height: int = 240) -> go.Figure:
    """A placeholder that says why there is nothing to draw yet."""
    return _figure(
        [],
        {
            "height": height,
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "annotations": [
                {
                    "text": message,
                    "showarrow": False,
                    "xref": "paper",
                    "yref": "paper",
                    "x": 0.5,
                    "y": 0.5,
                    "font": {"size": 15, "color": "#666"},
                }
            ],
        },
    )


def _legend_swatch(name: str, color: str, symbol: str = "square", **marker: Any) -> dict:
    # A legend-only entry for things drawn without a legend of their own (bands, colour keys).
    return {
        "type": "scatter",
        "x": [None],
        "y": [None],
        "mode": "markers",
        "name": name,
        "marker": {"color": color, "symbol": symbol, "size": 12, **marker},
        "hoverinfo": "skip",
    }


def _requests_by_uid(requests: Sequence[Message]) -> dict[int, Message]:
    return {int(r["uid"]): r for r in requests}


# ---- 1. batch composition ---------------------------------------------------------------------


def _batch_parts(
    steps: Sequence[Message], axis: StepAxis, stalled: np.ndarray, yaxis: str = "y"
) -> tuple[list[dict], dict[str, Any]]:
    """Stacked tokens per step (prompt pieces hatched, decodes solid), budget, phase, stalls."""
    n = len(steps)
    width = axis.hi - axis.lo
    totals = np.fromiter(
        (sum(i["end"] - i["start"] for i in s["items"]) for s in steps), dtype=np.int64, count=n
    )
    budgets = np.fromiter((s["budget"] for s in steps), dtype=np.int64, count=n)
    top = float(max(totals.max(initial=1), 1))
    budget_max = float(budgets.max(initial=0))
    # A budget far above every batch would flatten the bars; keep it off-chart, labelled.
    budget_visible = budget_max <= 4 * top
    y_top = 1.12 * (max(top, budget_max) if budget_visible else top)
    data: list[dict] = []

    # The phase band's cell edges: steps tile the axis, one background cell per step.
    if axis.mode == "time":
        edges_x = np.append(axis.lo, axis.hi[-1])
    else:
        edges_x = np.append(axis.numbers - 0.5, axis.numbers[-1] + 0.5)
    codes = [PHASE_CODES.get(s["phase"], 2) for s in steps]
    scale = []
    for code, phase in enumerate(PHASE_COLORS):
        scale += [[code / 3, PHASE_COLORS[phase]], [(code + 1) / 3, PHASE_COLORS[phase]]]
    data.append(
        {
            "type": "heatmap",
            "x": edges_x,
            "y": [0, y_top],
            "z": [codes],
            "zmin": -0.5,
            "zmax": 2.5,
            "colorscale": scale,
            "showscale": False,
            "hoverinfo": "skip",
            "yaxis": yaxis,
            "name": "phase",
        }
    )

    if n <= DETAIL_STEPS:
        data += _segment_bars(steps, axis, width, yaxis)
    else:
        data += _total_bars(steps, axis, width, yaxis)

    bx = np.column_stack([axis.lo, axis.hi]).ravel()
    by = np.repeat(budgets, 2)
    data.append(
        {
            "type": "scatter",
            "x": bx,
            "y": by,
            "mode": "lines",
            "name": "budget (max_extend_tokens)",
            "line": {"color": "#222", "width": 2, "dash": "dash"},
            "yaxis": yaxis,
            "hovertemplate": "budget %{y}<extra></extra>",
            "visible": True if budget_visible else "legendonly",
        }
    )
    hit = np.flatnonzero(stalled)
    data.append(
        {
            "type": "scatter",
            "x": axis.mid[hit],
            "y": np.full(len(hit), -0.05 * y_top),
            "mode": "markers",
            "name": "decode stalled",
            "marker": {"color": STALL_RED, "symbol": "triangle-up", "size": 7},
            "customdata": stalled[hit],
            "hovertemplate": "%{customdata} decoding request(s) got no token<extra></extra>",
            "yaxis": yaxis,
        }
    )
    for phase, color in PHASE_COLORS.items():
        data.append(_legend_swatch(f"{phase} step", color, line={"color": "#999", "width": 1}))
    annotations = []
    if not budget_visible:
        annotations.append(
            {
                "text": f"budget {int(budget_max)} ↑ (above the chart)",
                "xref": "paper",
                "yref": f"{yaxis} domain",
                "x": 1,
                "y": 1,
                "xanchor": "right",
                "yanchor": "top",
                "showarrow": False,
                "font": {"size": 12},
            }
        )
    yaxis_layout = {"title": {"text": "tokens in step"}, "range": [-0.09 * y_top, y_top]}
    layout = {"yaxis": yaxis_layout, "annotations": annotations}
    return data, layout | {"uniformtext": {"minsize": 9, "mode": "hide"}}


def _segment_bars(
    steps: Sequence[Message], axis: StepAxis, width: np.ndarray, yaxis: str
) -> list[dict]:
    cols: dict[str, dict[str, list]] = {
        k: {"x": [], "y": [], "base": [], "w": [], "color": [], "cd": []}
        for k in ("prompt", "decode")
    }
    mids, widths = axis.mid.tolist(), (width * 0.9).tolist()  # plain floats serialize faster
    for i, step in enumerate(steps):
        base = 0
        # Decodes at the bottom, prompt pieces on top, so the prompt share reads as one block.
        items = sorted(step["items"], key=lambda it: it["kind"] != "decode")
        for item in items:
            n = item["end"] - item["start"]
            col = cols["decode" if item["kind"] == "decode" else "prompt"]
            col["x"].append(mids[i])
            col["y"].append(n)
            col["base"].append(base)
            col["w"].append(widths[i])
            col["color"].append(request_color(item["uid"]))
            col["cd"].append((item["uid"], item["kind"], item["start"], item["end"], step["step"]))
            base += n
    out = []
    for key, name, pattern in (
        ("prompt", "prompt chunk (hatched)", {"shape": "/", "fillmode": "overlay"}),
        ("decode", "decode token (solid)", {"shape": ""}),
    ):
        col = cols[key]
        # Prompt pieces carry their range, upright inside the bar; plotly hides what won't fit.
        labels = (
            {
                "text": [f"req {c[0]} [{c[2]}:{c[3]})" for c in col["cd"]],
                "textposition": "inside",
                "textangle": -90,
                "insidetextanchor": "middle",
                "textfont": {"color": "white", "size": 11},
            }
            if key == "prompt"
            else {"textposition": "none"}
        )
        out.append(
            {
                **labels,
                "type": "bar",
                "name": name,
                "x": col["x"],
                "y": col["y"],
                "base": col["base"],
                "width": col["w"],
                "marker": {
                    "color": col["color"],
                    "pattern": {**pattern, "fgcolor": "white", "fgopacity": 0.8, "size": 6},
                    "line": {"width": 0},
                },
                "customdata": col["cd"],
                "hovertemplate": "step %{customdata[4]} · req %{customdata[0]} · "
                "%{customdata[1]} [%{customdata[2]}:%{customdata[3]})<extra></extra>",
                "yaxis": yaxis,
            }
        )
    return out


def _total_bars(
    steps: Sequence[Message], axis: StepAxis, width: np.ndarray, yaxis: str
) -> list[dict]:
    n = len(steps)
    prompt = np.fromiter(
        (sum(i["end"] - i["start"] for i in s["items"] if i["kind"] != "decode") for s in steps),
        dtype=np.int64,
        count=n,
    )
    decode = np.fromiter(
        (sum(1 for i in s["items"] if i["kind"] == "decode") for s in steps),
        dtype=np.int64,
        count=n,
    )
    common = {"type": "bar", "x": axis.mid, "width": width * 0.9, "yaxis": yaxis}
    return [
        {
            **common,
            "name": "decode tokens (all requests)",
            "y": decode,
            "base": np.zeros(n),
            "marker": {"color": "#555", "line": {"width": 0}},
            "hovertemplate": "%{y} decode tokens<extra></extra>",
        },
        {
            **common,
            "name": "prompt tokens (all requests, hatched)",
            "y": prompt,
            "base": decode,
            "marker": {
                "color": "#999",
                "pattern": {"shape": "/", "fillmode": "overlay", "fgcolor": "white"},
                "line": {"width": 0},
            },
            "hovertemplate": "%{y} prompt tokens<extra></extra>",
        },
    ]


def batch_figure(
    steps: Sequence[Message], requests: Sequence[Message] = (), x: XMode = "step"
) -> go.Figure:
    """Batch composition per step: who got how many tokens, against the budget line."""
    if not steps:
        return empty_figure("No engine steps recorded yet: submit a prompt.")
    if aggregate.any_aggregate(steps):  # an external source: counts, no requests
        return aggregate.aggregate_figure(steps, x)
    axis = step_axis(steps, x)
    all_stalls = stalls(steps, tracks(steps), _requests_by_uid(requests))
    data, layout = _batch_parts(steps, axis, stalled_per_step(len(steps), all_stalls))
    layout |= {"height": 380, "barmode": "overlay", "xaxis": {"title": {"text": X_TITLES[x]}}}
    return _figure(data, layout)


# ---- 2. request lanes -------------------------------------------------------------------------


def _lane_order(
    all_tracks: dict[int, Track], requests: Sequence[Message], max_lanes: int
) -> list[int]:
    seen = list(all_tracks)
    # Requests still queued have no step yet but deserve a lane: they are what is waiting.
    pending = [
        int(r["uid"])
        for r in requests
        if r.get("state") == "waiting" and int(r["uid"]) not in all_tracks
    ]
    return (seen + pending)[-max_lanes:]


def _lane_parts(
    steps: Sequence[Message],
    requests: Sequence[Message],
    axis: StepAxis,
    max_lanes: int,
    yaxis: str = "y",
    legend_all: bool = True,
) -> tuple[list[dict], dict[str, Any], list[int]]:
    all_tracks = tracks(steps)
    by_uid = _requests_by_uid(requests)
    uids = _lane_order(all_tracks, requests, max_lanes)
    shown = set(uids)
    segs: dict[str, dict[str, list]] = {
        k: {"y": [], "base": [], "x": [], "color": [], "text": [], "hover": []}
        for k in ("waiting", "chunk", "decode", "stall")
    }

    def add(kind: str, uid: int, x0: float, x1: float, text: str, hover: str) -> None:
        seg = segs[kind]
        seg["y"].append(f"req {uid}")
        seg["base"].append(x0)
        seg["x"].append(max(x1 - x0, 0.0))
        seg["color"].append(STALL_RED if kind == "stall" else request_color(uid))
        seg["text"].append(text)
        seg["hover"].append(hover)

    numbers = axis.numbers
    end_x = float(axis.hi[-1])
    for uid in uids:
        track = all_tracks.get(uid)
        rec = by_uid.get(uid, {})
        tq = rec.get("t_queued")
        start_x = axis.x_at_time(tq) if tq is not None else None
        if track is None:
            if start_x is not None:
                add("waiting", uid, max(start_x, float(axis.lo[0])), end_x, "", "waiting")
            continue
        cursor = max(start_x, float(axis.lo[0])) if start_x is not None else None
        for i, kind, a, b in track.chunks:
            if cursor is not None and axis.lo[i] > cursor:
                add("waiting", uid, cursor, float(axis.lo[i]), "", "waiting")
            add(
                "chunk",
                uid,
                float(axis.lo[i]),
                float(axis.hi[i]),
                f"[{a}:{b})",
                f"step {numbers[i]} · {kind} [{a}:{b}) · {b - a} tokens",
            )
            cursor = float(axis.hi[i])
        for first, last in _runs(track.decode_steps, numbers):
            add(
                "decode",
                uid,
                float(axis.lo[first]),
                float(axis.hi[last]),
                "",
                f"decode steps {numbers[first]}–{numbers[last]} · {last - first + 1} tokens",
            )
    for s in stalls(steps, all_tracks, by_uid):
        if s.uid not in shown:
            continue
        x0 = float(axis.hi[s.first - 1])
        x1 = float(axis.hi[s.last]) if s.ongoing else float(axis.lo[s.last + 1])
        label = "stalled (still waiting)" if s.ongoing else "stall"
        add("stall", s.uid, x0, x1, "", f"{label}: {s.seconds * 1000:.0f} ms without a token")

    data: list[dict] = []
    styles = {
        "waiting": ("waiting", {"color": WAIT_GREY, "opacity": 0.55}),
        "chunk": ("prompt chunk [start:end)", {"pattern": {"shape": "/", "fillmode": "overlay"}}),
        "decode": ("decoding", {}),
        "stall": ("stall (no token this step)", {}),
    }
    for kind, (name, style) in styles.items():
        seg = segs[kind]
        marker = {"color": seg["color"], "line": {"width": 0}, **style}
        if "pattern" in marker:
            marker["pattern"] = {**marker["pattern"], "fgcolor": "white", "fgopacity": 0.8}
        trace: dict[str, Any] = {
            "type": "bar",
            "orientation": "h",
            "name": name,
            "y": seg["y"],
            "x": seg["x"],
            "base": seg["base"],
            "marker": marker,
            "customdata": seg["hover"],
            "hovertemplate": "%{y} · %{customdata}<extra></extra>",
            "width": 0.62 if kind != "waiting" else 0.3,
            "yaxis": yaxis,
            # Under the batch chart, chunks and decodes already have legend entries.
            "showlegend": legend_all or kind in ("waiting", "stall"),
        }
        if kind == "chunk":
            trace |= {
                "text": seg["text"],
                "textposition": "inside",
                "insidetextanchor": "middle",
                "textfont": {"color": "white", "size": 11},
            }
        data.append(trace)
    labels = [f"req {u}" for u in uids]
    layout = {
        "yaxis": {
            "title": {"text": "request"},
            "categoryorder": "array",
            "categoryarray": labels[::-1],
            "type": "category",
        },
        "uniformtext": {"minsize": 9, "mode": "hide"},
    }
    return data, layout, uids


def _runs(indices: Sequence[int], numbers: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive engine steps among `indices`."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and numbers[i] - numbers[out[-1][1]] == 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def lanes_figure(
    steps: Sequence[Message],
    requests: Sequence[Message],
    x: XMode = "step",
    max_lanes: int = MAX_REQUEST_TRACES,
) -> go.Figure:
    """One lane per request: waiting, labelled prompt chunks, decode runs and red stalls."""
    if not steps:
        return empty_figure("No engine steps recorded yet: submit a prompt.")
    axis = step_axis(steps, x)
    data, layout, uids = _lane_parts(steps, requests, axis, max_lanes)
    layout |= {
        "height": max(260, 70 + 26 * len(uids)),
        "barmode": "overlay",
        "xaxis": {"title": {"text": X_TITLES[x]}},
    }
    return _figure(data, layout)


def timeline_figure(
    steps: Sequence[Message],
    requests: Sequence[Message],
    x: XMode = "step",
    max_lanes: int = MAX_REQUEST_TRACES,
) -> go.Figure:
    """Batch composition on top and request lanes below, sharing one x axis (zoom together)."""
    if not steps:
        return empty_figure("No engine steps recorded yet: submit a prompt.")
    if aggregate.any_aggregate(steps):  # an external source: counts, no request lanes
        return aggregate.aggregate_figure(steps, x)
    axis = step_axis(steps, x)
    all_stalls = stalls(steps, tracks(steps), _requests_by_uid(requests))
    batch, batch_layout = _batch_parts(steps, axis, stalled_per_step(len(steps), all_stalls))
    lanes, lane_layout, uids = _lane_parts(
        steps, requests, axis, max_lanes, yaxis="y2", legend_all=False
    )
    lane_px = 26 * max(len(uids), 3)
    batch_px = 300
    height = batch_px + lane_px + 130
    split = lane_px / (lane_px + batch_px)
    layout = {
        "height": height,
        "barmode": "overlay",
        "xaxis": {"title": {"text": X_TITLES[x]}, "anchor": "y2"},
        "yaxis": {**batch_layout["yaxis"], "domain": [split + 0.06, 1.0]},
        "yaxis2": {**lane_layout["yaxis"], "domain": [0.0, split], "anchor": "x"},
        "annotations": batch_layout["annotations"],
        "uniformtext": lane_layout["uniformtext"],
    }
    return _figure(batch + lanes, layout)


# ---- 3. KV pool -------------------------------------------------------------------------------


def kv_figure(
    steps: Sequence[Message], page_size: int = 1, x: XMode = "time", whole_pool: bool = True
) -> go.Figure:
    """Pages used, cached and free, stacked to the pool's total; reservations as a line.

    With `whole_pool=False` the y axis stops a little above the pages in use (or promised), so
    a big pool's small occupancy stays readable; free pages fill the rest of the view.
    """
    if not steps:
        return empty_figure("No engine steps recorded yet.")
    if aggregate.any_aggregate(steps):  # usage is all these sources say: no used/cached/free
        return aggregate.aggregate_figure(steps, x)
    axis = step_axis(steps, x)
    xs = axis.t1 if x == "time" else axis.numbers
    data = []
    for key in ("used", "cached", "free"):
        data.append(
            {
                "type": "scatter",
                "x": xs,
                "y": np.fromiter((s["kv"][key] for s in steps), dtype=np.int64, count=len(steps)),
                "name": f"{key} pages",
                "mode": "lines",
                "stackgroup": "kv",
                "line": {"width": 0.5, "color": KV_COLORS[key], "shape": "hv"},
                "fillcolor": KV_COLORS[key],
                "hovertemplate": f"{key} %{{y}} pages<extra></extra>",
            }
        )
    reserved = np.fromiter(
        (math.ceil(s["kv"]["reserved"] / page_size) for s in steps),
        dtype=np.int64,
        count=len(steps),
    )
    data.append(
        {
            "type": "scatter",
            "x": xs,
            "y": reserved,
            "name": f"reserved (tokens ÷ page size {page_size}, in pages)",
            "mode": "lines",
            "line": {"color": "#222", "dash": "dot", "width": 2, "shape": "hv"},
            "hovertemplate": "reserved %{y} pages<extra></extra>",
        }
    )
    total = max(int(steps[-1]["kv"]["total"]), 1)
    top = max(total, int(reserved.max(initial=0)))
    if not whole_pool:
        held = max(s["kv"]["used"] + s["kv"]["cached"] for s in steps)
        top = min(top, max(8, int(1.3 * max(held, int(reserved.max(initial=0))))))
    layout = {
        "height": 380,
        "hovermode": "x unified",
        "xaxis": {"title": {"text": X_TITLES[x]}},
        "yaxis": {
            "title": {"text": "KV pages"},
            "range": [0, 1.04 * top],
        },
    }
    return _figure(data, layout)


# ---- 4. decode progress -----------------------------------------------------------------------


def _recent_tracks(all_tracks: dict[int, Track]) -> list[Track]:
    with_tokens = [t for t in all_tracks.values() if t.token_steps]
    return with_tokens[-MAX_REQUEST_TRACES:]


def decode_progress_figure(steps: Sequence[Message], requests: Sequence[Message]) -> go.Figure:
    """Cumulative generated tokens over time: a flat stretch is a generation stall."""
    if not steps:
        return empty_figure("No engine steps recorded yet.")
    axis = step_axis(steps, "time")
    all_tracks = tracks(steps)
    all_stalls = stalls(steps, all_tracks, _requests_by_uid(requests))
    sampled = np.fromiter(
        (sum(1 for i in s["items"] if i["kind"] != "chunk") for s in steps),
        dtype=np.int64,
        count=len(steps),
    )
    total = np.cumsum(sampled)
    top = float(max(total[-1], 1)) * 1.05
    stalled = stalled_per_step(len(steps), all_stalls)
    hit = np.flatnonzero(stalled)
    data: list[dict] = [
        {
            "type": "bar",
            "x": axis.mid[hit],
            "width": (axis.t1 - axis.t0)[hit],
            "y": np.full(len(hit), top),
            "name": "decode stalled",
            "marker": {"color": STALL_RED, "opacity": 0.18, "line": {"width": 0}},
            "customdata": stalled[hit],
            "hovertemplate": "%{customdata} decoding request(s) waited<extra></extra>",
        },
        {
            "type": "scatter",
            "x": np.append(axis.t0[:1], axis.t1),
            "y": np.append([0], total),
            "name": "all requests",
            "mode": "lines",
            "line": {"color": "#222", "width": 3, "shape": "hv"},
            "hovertemplate": "%{y} tokens by %{x:.2f} s<extra></extra>",
        },
    ]
    for track in _recent_tracks(all_tracks):
        t = axis.t1[track.token_steps]
        data.append(
            {
                "type": "scatter",
                "x": t,
                "y": np.arange(1, len(t) + 1),
                "name": f"req {track.uid}",
                "mode": "lines",
                "line": {"color": request_color(track.uid), "width": 1.5, "shape": "hv"},
                "legendgroup": "requests",
                "showlegend": False,
                "hovertemplate": f"req {track.uid} · token %{{y}} at %{{x:.2f}} s<extra></extra>",
            }
        )
    layout = {
        "height": 360,
        "barmode": "overlay",
        "xaxis": {"title": {"text": X_TITLES["time"]}},
        "yaxis": {"title": {"text": "generated tokens"}, "range": [0, top]},
    }
    return _figure(data, layout)


# ---- 5. inter-token latency -------------------------------------------------------------------


def itl_figure(steps: Sequence[Message], requests: Sequence[Message]) -> go.Figure:
    """Time since each request's previous token; stalls red, the worst one labelled."""
    if not steps:
        return empty_figure("No engine steps recorded yet.")
    all_tracks = tracks(steps)
    data: list[dict] = []
    worst: tuple[float, float, int, bool] | None = None
    for track in _recent_tracks(all_tracks):
        g = token_gaps(steps, track)
        if not len(g.itl):
            continue
        ms = g.itl * 1000
        color = request_color(track.uid)
        data.append(
            {
                "type": "scatter",
                "x": g.t,
                "y": ms,
                "name": f"req {track.uid}",
                "mode": "lines+markers",
                "line": {"color": color, "width": 1},
                "marker": {
                    "color": np.where(g.stalled, STALL_RED, color),
                    "size": np.where(g.stalled, 10, 5),
                },
                "customdata": g.step,
                "hovertemplate": f"req {track.uid} · step %{{customdata}} · "
                "%{y:.0f} ms since its last token<extra></extra>",
            }
        )
        k = int(np.argmax(g.itl))
        if worst is None or g.itl[k] > worst[0]:
            worst = (float(g.itl[k]), float(g.t[k]), track.uid, bool(g.stalled[k]))
    annotations = []
    if worst is not None:
        label = "worst stall" if worst[3] else "longest gap (no stall)"
        annotations.append(
            {
                "x": worst[1],
                "y": worst[0] * 1000,
                "text": f"{label}: {worst[0] * 1000:.0f} ms · req {worst[2]}",
                "showarrow": True,
                "arrowhead": 2,
                "ax": -60,
                "ay": -30,
                "font": {"color": STALL_RED if worst[3] else "#333", "size": 12},
            }
        )
    else:
        annotations.append(
            {
                "text": "No request has two tokens yet.",
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "showarrow": False,
            }
        )
    data.append(_legend_swatch("stall (skipped steps)", STALL_RED, symbol="circle"))
    layout = {
        "height": 360,
        "xaxis": {"title": {"text": X_TITLES["time"]}},
        "yaxis": {"title": {"text": "inter-token latency (ms)"}, "rangemode": "tozero"},
        "annotations": annotations,
    }
    return _figure(data, layout)
