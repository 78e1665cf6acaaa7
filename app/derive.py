"""The page's headline (its metric row) from recorded step messages: per-request tracks, token
times and stalls. The charts' own view model is app/live/encode.py.

Token times come from the steps (a `prefill` or `decode` item samples one token at the step's
`t1`), not from `token` messages, so a reconnecting page that only has `hello.history` derives
the same latencies as one that watched live.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from instrumentation.fold import Stall, percentile
from instrumentation.fold import stalls as fold_stalls

Message = dict[str, Any]
SAMPLING_KINDS = frozenset({"prefill", "decode"})


@dataclass
class Track:
    """One request's part in the recorded steps (indices are positions in the step list)."""

    uid: int
    chunks: list[tuple[int, str, int, int]] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)
    decode_steps: list[int] = field(default_factory=list)


def tracks(steps: Sequence[Message]) -> dict[int, Track]:
    """Every request seen in `steps`, in order of first appearance."""
    out: dict[int, Track] = {}
    for i, step in enumerate(steps):
        for item in step["items"]:
            uid = item["uid"]
            track = out.get(uid)
            if track is None:
                track = out[uid] = Track(uid)
            kind = item["kind"]
            if kind == "decode":
                track.decode_steps.append(i)
            else:
                track.chunks.append((i, kind, item["start"], item["end"]))
            if kind in SAMPLING_KINDS and not item.get("wasted"):
                track.token_steps.append(i)
    return out


def stalls(
    steps: Sequence[Message], all_tracks: Mapping[int, Track], requests: Mapping[int, Message]
) -> list[Stall]:
    """Gaps between a request's tokens that skipped steps; trailing ones while it still runs
    (the shared fold's definition: instrumentation.fold.stalls)."""
    running = [uid for uid in all_tracks if requests.get(uid, {}).get("state") == "running"]
    sampled = {uid: t.token_steps for uid, t in all_tracks.items() if t.token_steps}
    return fold_stalls(steps, running, sampled)


@dataclass(frozen=True)
class Gaps:
    """Inter-token latencies of one request: token `k` at `t[k]` came `itl[k]` s after the last."""

    uid: int
    t: np.ndarray
    step: np.ndarray
    itl: np.ndarray
    stalled: np.ndarray


def token_gaps(steps: Sequence[Message], track: Track) -> Gaps:
    idx = np.asarray(track.token_steps, dtype=np.int64)
    t1 = np.fromiter((steps[i]["t1"] for i in idx), dtype=np.float64, count=len(idx))
    num = np.fromiter((steps[i]["step"] for i in idx), dtype=np.int64, count=len(idx))
    return Gaps(
        uid=track.uid,
        t=t1[1:],
        step=num[1:],
        itl=np.diff(t1),
        stalled=np.diff(num) > 1,
    )


@dataclass(frozen=True)
class Headline:
    tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    worst_stall: float | None
    worst_stall_uid: int | None
    kv_used: float | None
    kv_cached: float | None
    running: int
    waiting: int


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    return percentile([float(v) for v in values], q)


def headline(
    steps: Sequence[Message], requests: Sequence[Message], rate_window_s: float = 10.0
) -> Headline:
    """The numbers of the metric row, over the given steps and request records.

    `worst_stall` is None when no request had a decode skipped.
    """
    ttfts = [
        r["t_first_token"] - r["t_queued"]
        for r in requests
        if r.get("t_first_token") is not None and r.get("t_queued") is not None
    ]
    if not steps:
        return Headline(None, _pct(ttfts, 50), _pct(ttfts, 99), *([None] * 6), 0, 0)
    all_tracks = tracks(steps)
    gaps = [token_gaps(steps, t) for t in all_tracks.values()]
    itls = np.concatenate([g.itl for g in gaps]) if gaps else np.zeros(0)
    by_uid = {int(r["uid"]): r for r in requests}
    # A stall is a gap that skipped steps; a slow step that included the request is not one.
    all_stalls = stalls(steps, all_tracks, by_uid)
    worst = max(all_stalls, key=lambda s: s.seconds, default=None)
    last = steps[-1]
    horizon = last["t1"] - rate_window_s
    recent = [s for s in steps if s["t1"] >= horizon]
    span = last["t1"] - max(recent[0]["t0"], horizon)
    sampled = sum(1 for s in recent for i in s["items"] if i["kind"] in SAMPLING_KINDS)
    kv = last.get("kv") or {}
    total = kv.get("total") or 0
    queue = last.get("queue") or {}
    return Headline(
        tokens_per_s=sampled / span if span > 0 else None,
        ttft_p50=_pct(ttfts, 50),
        ttft_p99=_pct(ttfts, 99),
        itl_p50=_pct(itls, 50),
        itl_p99=_pct(itls, 99),
        worst_stall=worst.seconds if worst else None,
        worst_stall_uid=worst.uid if worst else None,
        kv_used=kv.get("used", 0) / total if total else None,
        kv_cached=kv.get("cached", 0) / total if total else None,
        running=int(queue.get("running", 0)),
        waiting=int(queue.get("waiting", 0)),
    )
