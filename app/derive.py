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
    worst_stall: float | None
    worst_stall_uid: int | None
    # running requests whose last token is older than the last step (a stall not yet ended:
    # it counts as one when their next token comes), and the longest of those waits
    stalled_now: int
    stalled_now_s: float | None
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
    rows = list(requests)
    s = summarize_steps(steps, rows)
    running = [int(r["uid"]) for r in rows if r.get("state") == "running"]
    ongoing = [st.seconds for st in fold_stalls(steps, running) if st.ongoing]
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
        stalled_now=len(ongoing),
        stalled_now_s=max(ongoing, default=None),
        kv_used=kv.get("used", 0) / total if total else None,
        kv_cached=kv.get("cached", 0) / total if total else None,
        running=int(queue.get("running", 0)),
        waiting=int(queue.get("waiting", 0)),
    )
