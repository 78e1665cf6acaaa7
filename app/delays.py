"""The named delay on the page, as figures and table rows: who delayed each request, and why
it waited (instrumentation.delay, docs/protocol.md "Delay").

Every figure here is instrumentation's: a request's `Delay` (own, retracted, host, queue by
waiting reason, `by` another request), the run's `Blame` (who delayed whom, the total by
cause), a watched engine's `StepInterference`; this module only lays them out. Pure: no
Streamlit (app/delays_view.py draws the Delays tab).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from app.live.style import WAIT_GREY, X_TITLES, request_color
from instrumentation.blame import Blame, StepInterference
from instrumentation.delay import Delay
from instrumentation.protocol import WAIT_REASONS

MAX_BARS = 40  # requests the per-request figure shows (the newest), as the timeline's lanes
MAX_CULPRITS = 8  # other requests named in a figure's legend; the rest are "other requests"
MAX_PAIRS = 25  # rows of the who-delayed-whom table
# waiting is grey on the page (the timeline's lanes); a shade per reason
QUEUE_GREYS = {"budget": WAIT_GREY, "kv": "#a6a6a6", "max_running": "#8a8a8a",
               "reserved": "#dedede"}  # fmt: skip
HOST_COLOR = "#ececec"
RETRACTED_COLOR = "#444444"
OTHERS_COLOR = "#bdb7a4"

CAPTION = (
    "Each request's latency, queued to its last token, split by what the engine was doing "
    "meanwhile (docs/protocol.md, *Delay*): **its own work** (its prompt pieces' share of "
    "their steps and its decode steps, in its colour), **another request's work** (hatched, in "
    "that request's colour: a prompt chunk that ran while it was left out, or the share a "
    "chunk added to a mixed step), **waiting for admission** (grey, by the step's waiting "
    "reason), a **recompute** after a retraction, and **between steps** (the host's time). "
    "The parts add up to the latency."
)
RUN_CAPTION = (
    "Every request's latency added up, by cause (another request's work by whose it was), and "
    "who cost whom the most: seconds of the delayed request's latency charged to the culprit's "
    "work."
)
INTERFERENCE_CAPTION = (
    "Per step, the time its **prompt work added to its decodes**: the step's time minus what "
    "a decode-only step of as many decodes took in this run (a prompt-only step while others "
    "were running: its whole time). "
)
NOT_ATTRIBUTED = (
    "What cannot be attributed: the source names no request, so neither whose prompt it was "
    "nor which decodes waited for it."
)


def _s(x: float) -> float:
    return round(x, 3)


# ---- the requests table ---------------------------------------------------------------------


def reasons_in(delays: Mapping[int, Delay]) -> list[str]:
    """The waiting reasons any of `delays` waited for, in the protocol's order (then others,
    e.g. `unknown` in a stream from before reasons were named)."""
    seen = {r for d in delays.values() for r, s in d.queue.items() if s > 0}
    return [r for r in WAIT_REASONS if r in seen] + sorted(seen - set(WAIT_REASONS))


def wait_columns(delay: Delay | None, reasons: Sequence[str]) -> dict[str, Any]:
    """The requests table's delay columns for one request: seconds waited by reason (one
    column per reason in `reasons`), its own work, other requests' work, and who cost it most."""
    cols: dict[str, Any] = {f"waited: {r} (s)": None for r in reasons}
    cols.update({"own (s)": None, "by others (s)": None, "most delayed by": None})
    if delay is None:
        return cols
    for r in reasons:
        cols[f"waited: {r} (s)"] = _s(delay.queue.get(r, 0.0))
    cols["own (s)"] = _s(delay.own)
    cols["by others (s)"] = _s(sum(delay.by.values()))
    if delay.by:
        uid, s = max(delay.by.items(), key=lambda kv: kv[1])
        cols["most delayed by"] = f"request {uid} ({_s(s)} s)"
    return cols


# ---- the Delays tab -------------------------------------------------------------------------


def cause_label(cause: str) -> str:
    """A `Delay.parts()` / `Blame.by_cause` key in words."""
    if cause.startswith("queue:"):
        return f"waiting: {cause[6:]}"
    return {
        "own": "own work",
        "retracted": "recompute after a retraction",
        "host": "between steps",
        "by": "other requests' work",
    }.get(cause, cause)


def _culprits(delays: Mapping[int, Delay]) -> list[int]:
    """The other requests that cost `delays` the most, at most MAX_CULPRITS."""
    total: dict[int, float] = {}
    for d in delays.values():
        for uid, s in d.by.items():
            total[uid] = total.get(uid, 0.0) + s
    return sorted(total, key=lambda u: -total[u])[:MAX_CULPRITS]


def request_figure(delays: Mapping[int, Delay]) -> go.Figure:
    """One stacked bar per request (the newest MAX_BARS, oldest on top): its latency by cause."""
    shown = dict(list(delays.items())[-MAX_BARS:])
    uids = list(shown)
    labels = [f"req {u}" for u in uids]
    fig = go.Figure()

    def bar(name: str, xs: list[float], color: str | list[str], hover: str,
            pattern: str = "") -> None:  # fmt: skip
        if not any(x > 0 for x in xs):
            return
        texts = [f"{x / d.total:.0%}" if d.total > 0 else "" for x, d in zip(xs, shown.values(),
                 strict=True)]  # fmt: skip
        fig.add_bar(
            name=name, y=labels, x=[_s(x) for x in xs], orientation="h", customdata=texts,
            # overlay: the hatching on the bar's colour (the default replaces the colour)
            marker={"color": color, "line": {"width": 0},
                    "pattern": {"shape": pattern, "fillmode": "overlay", "fgcolor": "white",
                                "fgopacity": 0.8, "size": 6}},
            hovertemplate=f"%{{y}} · {hover}: %{{x:.3f}} s (%{{customdata}} of its latency)"
            "<extra></extra>",
        )  # fmt: skip

    ds = list(shown.values())
    bar("own work", [d.own for d in ds], [request_color(u) for u in uids], "its own work")
    culprits = _culprits(shown)
    for c in culprits:
        bar(f"request {c}'s work", [d.by.get(c, 0.0) for d in ds], request_color(c),
            f"request {c}'s work", "/")  # fmt: skip
    rest = [sum(s for u, s in d.by.items() if u not in culprits) for d in ds]
    bar("other requests' work", rest, OTHERS_COLOR, "other requests' work", "/")
    for r in reasons_in(shown):
        bar(f"waiting: {r}", [d.queue.get(r, 0.0) for d in ds], QUEUE_GREYS.get(r, WAIT_GREY),
            f"waiting for admission ({r})")  # fmt: skip
    bar("recompute after a retraction", [d.retracted for d in ds], RETRACTED_COLOR,
        "recomputing after a retraction", "x")  # fmt: skip
    bar("between steps", [d.host for d in ds], HOST_COLOR, "between steps (no step ran)")
    fig.add_scatter(
        y=labels, x=[_s(d.total) for d in ds], mode="text", text=[_latency(d.total) for d in ds],
        textposition="middle right", showlegend=False, hoverinfo="skip",
    )  # fmt: skip
    fig.update_layout(
        barmode="stack",
        height=140 + 26 * max(len(uids), 3),
        margin={"l": 70, "r": 60, "t": 10, "b": 40},
        xaxis_title="seconds of latency (queued → last token)",
        yaxis={"categoryorder": "array", "categoryarray": labels[::-1]},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 0, "traceorder": "normal"},
        hovermode="closest",
    )
    return fig


def _latency(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def run_causes(b: Blame) -> list[tuple[str, float, str]]:
    """The run's latency by cause, largest first: (label, seconds, colour); other requests'
    work split by culprit (the largest MAX_CULPRITS, then the rest)."""
    out: list[tuple[str, float, str]] = []
    for cause, s in b.by_cause.items():
        if s <= 0 or cause == "by":
            continue
        if cause.startswith("queue:"):
            color = QUEUE_GREYS.get(cause[6:], WAIT_GREY)
        else:
            color = {"own": "#4c78a8", "retracted": RETRACTED_COLOR}.get(cause, HOST_COLOR)
        out.append((cause_label(cause), s, color))
    culprits = list(b.by_culprit.items())
    for uid, s in culprits[:MAX_CULPRITS]:
        out.append((f"request {uid}'s work", s, request_color(uid)))
    rest = sum(s for _, s in culprits[MAX_CULPRITS:])
    if rest > 0:
        out.append(("other requests' work", rest, OTHERS_COLOR))
    return sorted(out, key=lambda row: -row[1])


def run_figure(b: Blame) -> go.Figure:
    """The run's latency by cause, one bar per cause (largest on top) with its share."""
    rows = run_causes(b)
    labels = [label for label, _, _ in rows]
    fig = go.Figure(
        go.Bar(
            y=labels, x=[_s(s) for _, s, _ in rows], orientation="h",
            marker={"color": [c for _, _, c in rows], "line": {"width": 0}},
            text=[f"{_latency(s)} · {s / b.latency:.0%}" if b.latency else "" for _, s, _ in rows],
            textposition="outside", cliponaxis=False,
            hovertemplate="%{y}: %{x:.3f} s<extra></extra>",
        )
    )  # fmt: skip
    fig.update_layout(
        height=90 + 26 * max(len(rows), 2),
        margin={"l": 10, "r": 90, "t": 10, "b": 40},
        xaxis_title=f"seconds, over {b.requests} requests' latency ({_latency(b.latency)})",
        yaxis={"categoryorder": "array", "categoryarray": labels[::-1], "automargin": True},
        showlegend=False,
    )
    return fig


def pair_rows(b: Blame, delays: Mapping[int, Delay]) -> list[dict[str, Any]]:
    """Who delayed whom, the largest first (MAX_PAIRS rows): culprit, victim, seconds and the
    share of the victim's latency."""
    rows = []
    for culprit, victim, s in b.pairs[:MAX_PAIRS]:
        total = delays[victim].total if victim in delays else 0.0
        rows.append({
            "culprit": f"request {culprit}",
            "delayed": f"request {victim}",
            "seconds": _s(s),
            "of its latency": f"{s / total:.0%}" if total > 0 else None,
        })  # fmt: skip
    return rows


def culprit_rows(b: Blame) -> list[dict[str, Any]]:
    """Seconds each request's work cost the others, the largest first."""
    victims: dict[int, int] = {}
    for culprit, _, _ in b.pairs:
        victims[culprit] = victims.get(culprit, 0) + 1
    return [{"request": f"request {u}", "cost the others (s)": _s(s), "requests it delayed":
             victims.get(u, 0)} for u, s in list(b.by_culprit.items())[:MAX_PAIRS]]  # fmt: skip


# ---- a watched engine ---------------------------------------------------------------------


def interference_figure(items: Sequence[StepInterference], x: str = "step") -> go.Figure:
    """Per step, the milliseconds its prompt work added to its decodes (a bar where it could
    be told); its `layout.meta` is its caption (`interference_caption`)."""
    told = [i for i in items if i.added is not None and (x == "time" or i.step is not None)]
    xs = [i.t1 if x == "time" else i.step for i in told]
    fig = go.Figure()
    fig.add_bar(
        name="added by prompt work", x=xs, y=[round(i.added * 1000, 2) for i in told],  # type: ignore[operator]
        marker={"color": OTHERS_COLOR, "line": {"width": 0},
                "pattern": {"shape": "/", "fillmode": "overlay", "fgcolor": "white"}},
        customdata=[[i.decodes, i.prompt_tokens, _ms(i.seconds), _ms(i.decode_alone)]
                    for i in told],
        hovertemplate="step %{x} · prompt work added %{y:.1f} ms<br>%{customdata[0]} decodes, "
        "%{customdata[1]} prompt tokens · step %{customdata[2]}, a decode-only step of as many "
        "decodes %{customdata[3]}<extra></extra>",
    )  # fmt: skip
    fig.update_layout(
        meta=interference_caption(items),  # the caption drawn under it
        height=260,
        margin={"l": 60, "r": 20, "t": 10, "b": 40},
        xaxis_title=X_TITLES.get(x, x),
        yaxis_title="ms added to the decodes",
        showlegend=False,
        bargap=0.1,
    )
    return fig


def _ms(s: float | None) -> str:
    return "–" if s is None else f"{s * 1000:.1f} ms"


def interference_caption(items: Sequence[StepInterference]) -> str:
    """What the figure shows, and what it cannot: the steps not estimated and why."""
    notes: dict[str, int] = {}
    for i in items:
        if i.added is None:
            notes[i.note] = notes.get(i.note, 0) + 1
    told = sum(i.added is not None for i in items)
    added = sum(i.added or 0.0 for i in items)
    text = INTERFERENCE_CAPTION + f"Over the {len(items):,} steps here: {_latency(added)} added"
    text += f" in {told:,} steps told. " + NOT_ATTRIBUTED
    for note, n in notes.items():
        text += f" {n:,} step(s) not estimated: {note}."
    return text
