"""The page's headline (its metric row) from recorded step messages: per-request tracks, token
times and stalls. The charts' own view model is app/live/encode.py.

Token times come from the steps (a `prefill` or `decode` item samples one token at the step's
`t1`), not from `token` messages, so a reconnecting page that only has `hello.history` derives
the same latencies as one that watched live. The headline's figures are the shared fold's
`Summary` over the steps given (`instrumentation.fold.summarize_steps`): replay compare and the
sweep show the same numbers for the same steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from instrumentation.fold import Stall, Summary, summarize_steps
from instrumentation.fold import stalls as fold_stalls
from instrumentation.metrics import stalled_between
from instrumentation.protocol import SAMPLING_KINDS

Message = dict[str, Any]


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
        stalled=np.fromiter(
            (stalled_between(int(a), int(b)) for a, b in zip(num, num[1:], strict=False)),
            dtype=bool,
            count=max(len(num) - 1, 0),
        ),
    )


@dataclass(frozen=True)
class Headline:
    """The metric row: the latency figures and throughput of `summary` (the shared fold's
    Summary over the steps given), which `scope` names, and the engine's state at the last step."""

    summary: Summary
    scope: str
    tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    itl_p999: float | None
    worst_stall: float | None
    worst_stall_uid: int | None
    kv_used: float | None
    kv_cached: float | None
    running: int
    waiting: int


def scope(summary: Summary, whole: bool | None = None) -> str:
    """What a summary covers, in words: the whole recording (`whole`: the caller knows the steps
    are all there is), the whole run (its steps start at the engine's step 0), or a window."""
    if not summary.steps or summary.first_step is None:
        return "no steps yet"
    span = f"steps {summary.first_step:,}–{summary.last_step:,}"
    if whole:
        return f"the whole recording ({span})"
    if whole is None and summary.first_step == 0:
        return f"the whole run ({span})"
    return f"the {summary.steps:,} steps in view ({span})"


def headline(
    steps: Sequence[Message], requests: Iterable[Message], whole: bool | None = None
) -> Headline:
    """The metric row over the given steps and request records; `whole` as for `scope`.
    `worst_stall` is None when no request had a decode skipped between two of its tokens in
    these steps."""
    s = summarize_steps(steps, requests)
    last = steps[-1] if steps else {}
    kv = last.get("kv") or {}
    total = kv.get("total") or 0
    queue = last.get("queue") or {}
    return Headline(
        summary=s,
        scope=scope(s, whole),
        tokens_per_s=s.output_tok_s,
        ttft_p50=s.ttft_p50_s,
        ttft_p99=s.ttft_p99_s,
        itl_p50=s.itl_p50_s,
        itl_p99=s.itl_p99_s,
        itl_p999=s.itl_p999_s,
        worst_stall=s.worst_stall_s,
        worst_stall_uid=s.worst_stall_uid,
        kv_used=kv.get("used", 0) / total if total else None,
        kv_cached=kv.get("cached", 0) / total if total else None,
        running=int(queue.get("running", 0)),
        waiting=int(queue.get("waiting", 0)),
    )
