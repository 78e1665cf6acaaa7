"""The page's headline (its metric row) from recorded step messages. The charts' own view model
is app/live/encode.py.

Token times come from the steps (a `prefill` or `decode` item samples one token at the step's
`t1`), not from `token` messages, so a reconnecting page that only has `hello.history` derives
the same latencies as one that watched live. The headline's figures are the shared fold's
`Summary` over the steps given (`instrumentation.fold.summarize_steps`): replay compare and the
sweep show the same numbers for the same steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from instrumentation.fold import Summary, summarize_steps
from instrumentation.fold import stalls as fold_stalls

Message = dict[str, Any]


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
    # the longest stall, ended or still going on (`worst_stall_ongoing`: no token ended it yet)
    worst_stall: float | None
    worst_stall_uid: int | None
    # requests waiting for their next token (running, or retracted and queued again) whose last
    # token is older than the last step: a stall not yet ended, and the longest of those waits
    stalled_now: int
    stalled_now_s: float | None
    kv_used: float | None
    kv_cached: float | None
    running: int
    waiting: int
    worst_stall_ongoing: bool = False


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
    rows = list(requests)
    s = summarize_steps(steps, rows)
    running = sum(r.get("state") == "running" for r in rows)
    waiting = sum(r.get("state") == "waiting" for r in rows)
    # a retracted request has tokens and waits for its next one like a running request does
    between_tokens = [
        int(r["uid"])
        for r in rows
        if r.get("state") == "running" or (r.get("state") == "waiting" and r.get("output_len"))
    ]
    ongoing = [st for st in fold_stalls(steps, between_tokens) if st.ongoing]
    longest = max(ongoing, key=lambda st: st.seconds, default=None)
    worst, worst_uid = s.worst_stall_s, s.worst_stall_uid
    ongoing_worst = longest is not None and (worst is None or longest.seconds > worst)
    if ongoing_worst:
        worst, worst_uid = longest.seconds, longest.uid  # type: ignore[union-attr]
    last = steps[-1] if steps else {}
    kv = pool_now(steps, rows)
    total = kv.get("total") or 0
    return Headline(
        summary=s,
        scope=scope(s, whole),
        tokens_per_s=s.output_tok_s,
        ttft_p50=s.ttft_p50_s,
        ttft_p99=s.ttft_p99_s,
        itl_p50=s.itl_p50_s,
        itl_p99=s.itl_p99_s,
        itl_p999=s.itl_p999_s,
        worst_stall=worst,
        worst_stall_uid=worst_uid,
        stalled_now=len(ongoing),
        stalled_now_s=None if longest is None else longest.seconds,
        kv_used=kv.get("used", 0) / total if total else None,
        kv_cached=kv.get("cached", 0) / total if total else None,
        running=running if rows or not last else int((last.get("queue") or {}).get("running", 0)),
        waiting=waiting if rows or not last else int((last.get("queue") or {}).get("waiting", 0)),
        worst_stall_ongoing=ongoing_worst,
    )


def pool_now(steps: Sequence[Message], requests: Sequence[Message]) -> dict[str, Any]:
    """The KV pool as it stands now: the newest of the last step's `kv` and the pool an ended
    request's event reported after giving its pages back (an engine that went idle publishes no
    step after its last request ends)."""
    last = steps[-1] if steps else {}
    kv, t = last.get("kv") or {}, float(last.get("t1") or float("-inf"))
    for r in requests:
        after = r.get("kv_after")
        if after and float(r.get("t_finished") or float("-inf")) >= t:
            kv, t = after, float(r["t_finished"])
    return kv
