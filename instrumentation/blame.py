"""What the page shows of the delay (instrumentation.delay): per request, per wait, for the run.

- `request_delay(fold, uid)`: a request's `Delay` (final once ended, so far while in flight).
- `request_gaps(fold, uid)`: the wait before each of its tokens, by cause and step
  (`GapDelay.describe()`: "38 ms: 31 ms request 9's prompt [512:768] in steps 812–814, ...").
- `request_wait(fold, uid, step=..., index=...)`: one of those waits, without building the
  others (the page describes a few new ones per update).
- `who_delayed_whom(fold)` / `blame(delays)`: (culprit, victim, seconds) largest first, seconds
  each request cost the others, and the run's total by cause.
- `worst_stall_cause(fold, summary)`: the headline's worst stall (instrumentation.metrics) and
  its main cause: "4.46 s — mostly request 4's prompt"; `stall_cause(uid, seconds, gap)` the
  same for a given wait (a stall still going on: `request_wait(fold, uid)`).
- `step_interference(steps)`: for a watched engine (no request ids), the time prompt work added
  to each step's decodes, and what cannot be attributed.

A fold made with `delays=True` knows every wait of what it folded; one without (the server's
history) knows each ended request's `delay` from its end event. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from instrumentation.delay import Delay
from instrumentation.fold import Fold, Summary
from instrumentation.step_cost import DecodeEstimate
from instrumentation.waits import Charge, GapDelay, describe_seconds

__all__ = [
    "Blame",
    "StallCause",
    "StepInterference",
    "blame",
    "cause_words",
    "request_delay",
    "request_gaps",
    "request_wait",
    "stall_cause",
    "step_interference",
    "who_delayed_whom",
    "worst_stall_cause",
]

Message = dict[str, Any]


def request_delay(fold: Fold, uid: int) -> Delay | None:
    """Who delayed a request and why: final once it ended (its end event's, or the fold's own
    ledger's), so far while in flight (a fold with `delays`); None where not known."""
    rec = fold.get(uid)
    if rec is not None and rec.ended:
        return rec.delay
    return None if fold.ledger is None else fold.ledger.delay(uid)


def request_gaps(fold: Fold, uid: int) -> list[GapDelay]:
    """The wait before each of a request's tokens (index 0: queued to its first token), by
    cause and step; for a request in flight its current wait last (`ongoing`). Only a fold made
    with `delays=True` has them (for what it folded); otherwise empty."""
    rec = fold.get(uid)
    if rec is not None and rec.ended:
        return list(rec.delay_gaps or ())
    return [] if fold.ledger is None else fold.ledger.gaps(uid)


def request_wait(
    fold: Fold, uid: int, *, step: int | None = None, index: int | None = None
) -> GapDelay | None:
    """One of a request's waits (as `request_gaps` gives them), built alone: the one its token
    in step `step` ended, or its `index`-th, or (neither given) its current one, while it is
    in flight and waits for a token (`ongoing`; also its index). None where not known."""
    rec = fold.get(uid)
    if rec is not None and rec.ended:
        gaps = rec.delay_gaps or []
        if index is not None:
            return gaps[index] if 0 <= index < len(gaps) else None
        if step is None:
            return None
        for g in reversed(gaps):  # the page asks for recent ones: search from the newest
            if g.last_step == step and not g.ongoing:
                return g
            if g.last_step is not None and g.last_step < step:
                break
        return None
    live = None if fold.ledger is None else fold.ledger.live.get(uid)
    log = None if live is None else live.log
    if log is None:
        return None
    # as WaitLog.gaps builds them: (t_start, t_end, first step, last step, stall, ongoing, runs)
    if index is not None and index != len(log.closed):  # that one is the current wait
        return _gap(uid, index, log.closed[index]) if 0 <= index < len(log.closed) else None
    if step is not None:
        for i in range(len(log.closed) - 1, -1, -1):
            last = log.closed[i][3]
            if last == step:
                return _gap(uid, i, log.closed[i])
            if last is not None and last < step:
                break
        return None
    if not log.runs:
        return None
    last_step = None if fold.ledger.last is None else fold.ledger.last.step  # type: ignore[union-attr]
    row = (live.t_last, live.cursor, log.runs[0].first, last_step, False, True, log.runs)
    return _gap(uid, len(log.closed), row)


def _gap(uid: int, index: int, row: tuple) -> GapDelay:
    a, b, first, last, stall, ongoing, runs = row
    return GapDelay(uid, index, a, b, first, last, stall, ongoing,
                    tuple(r.charge() for r in runs))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Blame:
    """A run's delays together. `pairs`: (culprit uid, victim uid, seconds), largest first;
    `by_culprit`: seconds each request cost the others, largest first; `by_cause`: seconds over
    every request by cause (`own`, `retracted`, `host`, `queue:<reason>`, `by`); `latency`: the
    latencies they split (the sum of `by_cause`)."""

    pairs: tuple[tuple[int, int, float], ...]
    by_culprit: dict[int, float]
    by_cause: dict[str, float]
    latency: float
    requests: int


def blame(delays: Mapping[int, Delay]) -> Blame:
    """Who delayed whom, from each request's `Delay` (victim uid → its delay)."""
    pairs: list[tuple[int, int, float]] = []
    culprits: dict[int, float] = {}
    causes: dict[str, float] = {}
    for victim, d in delays.items():
        for culprit, s in d.by.items():
            pairs.append((culprit, victim, s))
            culprits[culprit] = culprits.get(culprit, 0.0) + s
        for cause, s in d.parts().items():
            causes[cause] = causes.get(cause, 0.0) + s
    pairs.sort(key=lambda p: -p[2])
    return Blame(
        pairs=tuple(pairs),
        by_culprit=dict(sorted(culprits.items(), key=lambda kv: -kv[1])),
        by_cause=causes,
        latency=sum(causes.values()),
        requests=len(delays),
    )


def who_delayed_whom(fold: Fold, live: bool = True) -> Blame:
    """`blame` over the fold's requests: ended ones, and with `live` those in flight so far."""
    delays: dict[int, Delay] = {}
    for rec in fold.requests():
        if rec.ended or live:
            d = request_delay(fold, rec.uid)
            if d is not None:
                delays[rec.uid] = d
    return blame(delays)


def cause_words(c: Charge) -> str:
    """A cause as the headline says it: "request 4's prompt", "waiting for admission (kv)"."""
    if c.part == "by":
        return f"request {c.uid}'s {'decodes' if c.kind == 'decode' else c.kind}"
    if c.part == "queue":
        return f"waiting for admission ({c.reason})"
    if c.part == "host":
        return "time between steps"
    if c.part == "retracted":
        return "recomputing after a retraction"
    return f"its own {c.kind}"


@dataclass(frozen=True, slots=True)
class StallCause:
    """The worst stall of a Summary, `uid`'s wait of `seconds`, and its largest cause (`main`,
    `share` of the wait); `phrase`: "4.46 s — mostly request 4's prompt"."""

    uid: int
    seconds: float
    gap: GapDelay | None
    main: Charge | None
    share: float | None
    phrase: str


def worst_stall_cause(fold: Fold, summary: Summary | None = None) -> StallCause | None:
    """The main cause of `summary`'s worst stall (the fold's whole-run summary by default);
    None when there is no stall. Without the stall's wait by cause (a fold without `delays`,
    or a stall before it started), the phrase is the figure alone."""
    summary = fold.summary() if summary is None else summary
    uid, worst = summary.worst_stall_uid, summary.worst_stall_s
    if uid is None or worst is None:
        return None
    stalls = [g for g in request_gaps(fold, uid) if g.stall]
    gap = min(stalls, key=lambda g: abs(g.seconds - worst)) if stalls else None
    return stall_cause(uid, worst, gap)


def stall_cause(uid: int, seconds: float, gap: GapDelay | None) -> StallCause:
    """`uid`'s stall of `seconds` and the main cause of `gap`, its wait (a stall still going
    on: the request's current wait); without the wait, the phrase is the figure alone."""
    figure = describe_seconds(seconds)
    main = None if gap is None else gap.main()
    if gap is None or main is None or gap.seconds <= 0:
        return StallCause(uid, seconds, gap, None, None, figure)
    share = main.seconds / gap.seconds
    words = cause_words(main)
    said = f"mostly {words}" if share >= 0.5 else f"{words} the largest part ({share:.0%})"
    return StallCause(uid, seconds, gap, main, share, f"{figure} — {said}")


@dataclass(frozen=True, slots=True)
class StepInterference:
    """One watched step: `seconds` it took, `decode_alone` what a decode-only step of its
    `decodes` took in this run (instrumentation.delay.DecodeEstimate), and `added`: the time its
    prompt work added to the decodes (None where it cannot be told); `note` says what cannot be
    attributed."""

    step: int | None
    t1: float
    phase: str | None
    decodes: int | None
    prompt_tokens: int | None
    seconds: float | None
    decode_alone: float | None
    added: float | None
    note: str


_NO_IDS = "which requests' prompts and which decodes: the source names no request"


def step_interference(steps: Iterable[Message]) -> list[StepInterference]:
    """For watched engines' aggregate steps (vLLM iteration lines, SGLang batch logs, forward
    pass metrics: counts, no request ids): per step, what its prompt work added to its decodes.
    A mixed step: its time minus a decode-only step's of as many decodes (the same estimate as
    the delay's); a prompt-only step while other requests were running: its whole time (they
    waited for it); a decode-only step: nothing. Steps without a time of their own (SGLang's log
    stamps lines, not steps; a line summing several decode steps) are not estimated."""
    estimate = DecodeEstimate()
    out: list[StepInterference] = []
    for s in steps:
        t0, t1 = float(s.get("t0", 0.0)), float(s.get("t1", 0.0))
        sampled = int(s.get("sample_of_steps") or 1)
        d = t1 - t0 if t1 > t0 and sampled == 1 else None
        decodes, prompt = s.get("decode_requests"), s.get("prompt_tokens")
        running = (s.get("queue") or {}).get("running")
        alone = added = None
        note = _NO_IDS
        if d is None:
            note = "no time of its own in this source (stamped per line, or several steps)"
        elif decodes and not prompt:
            estimate.add(int(decodes), d)
            added = 0.0
        elif decodes and prompt:
            alone = estimate(int(decodes))
            if alone is None:
                note = "no decode-only step yet to compare with; " + _NO_IDS
            else:
                added = max(0.0, d - alone)
        elif prompt:
            others = (running or 0) - int(s.get("prefill_requests") or 0)
            added = d if others > 0 else 0.0
        out.append(StepInterference(s.get("step"), t1, s.get("phase"), decodes, prompt, d,
                                    alone, added, note))  # fmt: skip
    return out
