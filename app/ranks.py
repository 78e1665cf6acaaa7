"""Tensor-parallel ranks: each rank's forward time per step, so a straggler stands out.

Steps of a `tp_size > 1` engine carry `ranks: [{"rank", "forward_s", "comm_s"}, ...]`
(docs/protocol.md); a rank's time may be None (not measured), which is a gap, not a zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

Message = dict[str, Any]
RANK_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)


@dataclass
class RankSeries:
    """One rank's times over the steps that report ranks (same x for every rank)."""

    rank: int
    forward_ms: list[float | None] = field(default_factory=list)
    comm_ms: list[float | None] = field(default_factory=list)


def _ms(value: Any) -> float | None:
    return None if value is None else 1000.0 * float(value)


def rank_series(steps: Sequence[Message]) -> tuple[list[int], dict[int, RankSeries]]:
    """The step numbers that report ranks, and each rank's forward and comm times (ms) there."""
    with_ranks = [s for s in steps if s.get("ranks")]
    numbers = [int(s["step"]) for s in with_ranks]
    ids = sorted({int(r["rank"]) for s in with_ranks for r in s["ranks"]})
    series = {rank: RankSeries(rank) for rank in ids}
    for s in with_ranks:
        by_rank = {int(r["rank"]): r for r in s["ranks"]}
        for rank, out in series.items():
            r = by_rank.get(rank) or {}
            out.forward_ms.append(_ms(r.get("forward_s")))
            out.comm_ms.append(_ms(r.get("comm_s")))
    return numbers, series


def slowest_rank(series: dict[int, RankSeries]) -> int | None:
    """The rank with the largest mean forward time (the straggler, if there is one)."""
    means = {}
    for rank, s in series.items():
        known = [v for v in s.forward_ms if v is not None]
        if known:
            means[rank] = sum(known) / len(known)
    return max(means, key=means.__getitem__) if means else None


def tp_caption(engine: dict[str, Any]) -> str | None:
    tp = int(engine.get("tp_size") or 1)
    return f"tensor parallel over {tp} ranks" if tp > 1 else None


def ranks_figure(steps: Sequence[Message]) -> go.Figure:
    """Forward time per rank per step (solid) and its collectives' share (dotted)."""
    numbers, series = rank_series(steps)
    data: list[dict] = []
    for rank, s in series.items():
        color = RANK_COLORS[rank % len(RANK_COLORS)]
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": f"rank {rank} forward",
                "x": numbers,
                "y": s.forward_ms,
                "line": {"color": color, "width": 1.5},
                "hovertemplate": f"rank {rank}: %{{y:.2f}} ms forward<extra></extra>",
            }
        )
        if any(v is not None for v in s.comm_ms):
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": f"rank {rank} all-reduce",
                    "x": numbers,
                    "y": s.comm_ms,
                    "line": {"color": color, "width": 1, "dash": "dot"},
                    "hovertemplate": f"rank {rank}: %{{y:.2f}} ms all-reduce<extra></extra>",
                }
            )
    layout = {
        "height": 260,
        "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "xanchor": "left"},
        "hovermode": "x unified",
        "uirevision": "stepscope",
        "xaxis": {"title": {"text": "engine step"}},
        "yaxis": {"title": {"text": "ms"}, "rangemode": "tozero"},
    }
    return go.Figure(data=data, layout=layout)
