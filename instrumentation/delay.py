"""Every lost millisecond has a name: who delayed each request, and why it waited.

One definition (docs/protocol.md, "Delay"), computed from the message stream alone, so the
`finished` / `aborted` events, the page, a replayed recording, the trace export, `/metrics` and
the benchmarks agree. A request's latency, queued to its last token (`e2e_request_latency_seconds`
of instrumentation.metrics), is cut on the step clock into intervals, and each interval goes to
exactly one part of its `Delay`:

- `host`: no step ran (between one step's end and the next one's start).
- `queue[reason]`: it waited for admission (never admitted, or retracted and not yet readmitted)
  while a step ran; `reason` is that step's `queue.waiting_reason`, which names the head of the
  queue: under FIFO admission a request behind the head waits for the head's reason.
- `own`: its own work: its prompt pieces' share of their steps, and the decode steps it was in.
- `retracted`: its `recompute` pieces' share of their steps (a retraction threw that work away).
- `by[uid]`: another request's work, while this one was admitted but left out of a step (e.g. a
  prompt chunk under prefill_first), arrived while a step it could not be in ran, or shared a
  step with that work.

A step's time is its *span*: from the later of its `t0` and the previous step's `t1` to its `t1`
(with overlap a step is scheduled while the previous one runs; its span is what it added). How a
span is divided (`StepSplit`):

- the *cost split*: the step's decodes together cost what a decode-only step of as many decodes
  costs in this run (`DecodeEstimate`, never more than the span), shared equally; the prompt
  pieces (chunk, prefill, recompute) share the rest by tokens. A request left out of the step
  (or that arrived while it ran) is charged each piece's cost share.
- a decode in the step keeps the decode part as `own`; only the rest, what the prompt pieces
  riding along added, is charged to them.
- a prompt piece in the step is charged by tokens (a decode counts one token): its share is
  `own` (or `retracted`), the other pieces' shares go to their requests.

The parts add up to the latency by construction: each request keeps a cursor on the step clock,
and every step moves it to the step's end, charging what it passed to one part. A request that
ended without a token (aborted while waiting or prefilling) is covered up to its last step.
Pure Python, no torch.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from instrumentation.metrics import stalled_between
from instrumentation.protocol import ENDED_STATES

__all__ = [
    "Charge",
    "DecodeEstimate",
    "Delay",
    "DelayLedger",
    "GapDelay",
    "StepSplit",
    "TokenWait",
    "delays_of",
    "describe_seconds",
]

Message = dict[str, Any]
PROMPT_KINDS = frozenset(("chunk", "prefill", "recompute"))
# the waiting reason of a stream that names none (recordings from before protocol v1.3)
UNKNOWN_REASON = "unknown"
# decode-only samples kept per batch-size bucket: recent enough to follow a change of load
_SAMPLES = 64


@dataclass(slots=True)
class Delay:
    """A request's latency by part; `by` maps another request's uid to seconds. The parts add
    up to the latency (`total`)."""

    own: float = 0.0
    retracted: float = 0.0
    host: float = 0.0
    queue: dict[str, float] = field(default_factory=dict)
    by: dict[int, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (
            self.own + self.retracted + self.host + sum(self.queue.values()) + sum(self.by.values())
        )

    def add(self, other: Delay) -> None:
        self.own += other.own
        self.retracted += other.retracted
        self.host += other.host
        for reason, s in other.queue.items():
            self.queue[reason] = self.queue.get(reason, 0.0) + s
        for uid, s in other.by.items():
            self.by[uid] = self.by.get(uid, 0.0) + s

    def absorb(self, other: Delay) -> None:
        """Add `other` and empty it (no new objects: this runs once per token)."""
        self.own += other.own
        self.retracted += other.retracted
        self.host += other.host
        other.own = other.retracted = other.host = 0.0
        if other.queue:
            for reason, s in other.queue.items():
                self.queue[reason] = self.queue.get(reason, 0.0) + s
            other.queue.clear()
        if other.by:
            for uid, s in other.by.items():
                self.by[uid] = self.by.get(uid, 0.0) + s
            other.by.clear()

    def copy(self) -> Delay:
        return Delay(self.own, self.retracted, self.host, dict(self.queue), dict(self.by))

    def parts(self) -> dict[str, float]:
        """Seconds by cause: `own`, `retracted`, `host`, `queue:<reason>` and `by` (every other
        request together)."""
        out = {"own": self.own, "retracted": self.retracted, "host": self.host}
        out.update((f"queue:{r}", s) for r, s in self.queue.items())
        out["by"] = sum(self.by.values())
        return out

    def to_dict(self) -> dict[str, Any]:
        """The protocol's `delay` object: uids as strings (JSON object keys)."""
        return {
            "own": self.own,
            "retracted": self.retracted,
            "host": self.host,
            "queue": dict(self.queue),
            "by": {str(uid): s for uid, s in self.by.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Delay:
        return cls(
            float(d.get("own") or 0.0),
            float(d.get("retracted") or 0.0),
            float(d.get("host") or 0.0),
            {str(r): float(s) for r, s in (d.get("queue") or {}).items()},
            {int(uid): float(s) for uid, s in (d.get("by") or {}).items()},
        )


class DecodeEstimate:
    """What a decode-only step of `b` decodes costs in this run: the running median of the last
    spans of decode-only steps in its batch-size bucket; between known buckets interpolated
    linearly, beyond them a least-squares line (slope at least 0) over the buckets' medians.
    None before any decode-only step. Fed in step order, so every consumer of one stream gets
    the same estimates."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[int, float]]] = {}
        self._medians: dict[int, tuple[float, float]] = {}  # bucket -> (its batch size, median)

    @staticmethod
    def bucket(b: int) -> int:
        # exact up to 16 decodes, then quarter-octaves (about 19% apart)
        return b if b <= 16 else 16 + round(4 * math.log2(b / 16))

    def add(self, b: int, seconds: float) -> None:
        key = self.bucket(b)
        q = self._samples.get(key)
        if q is None:
            q = self._samples[key] = deque(maxlen=_SAMPLES)
        q.append((b, seconds))
        self._medians.pop(key, None)

    def _median(self, key: int) -> tuple[float, float]:
        m = self._medians.get(key)
        if m is None:
            q = self._samples[key]
            sizes = sorted(s for s, _ in q)
            spans = sorted(d for _, d in q)
            m = self._medians[key] = (float(sizes[len(sizes) // 2]), _mid(spans))
        return m

    def __call__(self, b: int) -> float | None:
        if not self._samples:
            return None
        key = self.bucket(b)
        if key in self._samples:
            return self._median(key)[1]
        points = sorted(self._median(k) for k in self._samples)
        i = bisect_left(points, (float(b), -math.inf))
        if 0 < i < len(points):
            (b0, d0), (b1, d1) = points[i - 1], points[i]
            return d0 + (d1 - d0) * (b - b0) / (b1 - b0) if b1 > b0 else d0
        return _line(points, b)


def _mid(xs: list[float]) -> float:
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _line(points: list[tuple[float, float]], b: int) -> float:
    if len(points) == 1:
        return points[0][1]
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in points) / sxx) if sxx else 0.0
    return max(0.0, my + slope * (b - mx))


@dataclass(slots=True)
class StepSplit:
    """One step as the ledger divides it. `span` is its time (see the module doc), `host` the
    time before it when no step ran; `cost` each request's cost share of the span, `decode_part`
    what its decodes together cost (the rest is its prompt pieces')."""

    step: int
    t0: float
    t1: float
    start: float  # where its span starts: max(t0, the previous step's t1)
    span: float
    items: dict[int, tuple[str, int, int]]  # uid -> (kind, start, end)
    decodes: int
    prompt_tokens: int
    decode_part: float
    cost: dict[int, float]
    retracted: frozenset[int]
    reason: str
    _tokens: dict[int, float] | None = None

    @property
    def prompt_part(self) -> float:
        return self.span - self.decode_part

    def token_share(self) -> dict[int, float]:
        """The span by tokens (a decode counts one): how a prompt piece in it is charged."""
        if self._tokens is None:
            n = self.prompt_tokens + self.decodes
            self._tokens = {
                u: self.span * _tokens(k, a, b) / n for u, (k, a, b) in self.items.items()
            }
        return self._tokens


def _tokens(kind: str, start: int, end: int) -> int:
    return 1 if kind == "decode" else max(1, end - start)


def split_step(step: Message, prev_t1: float | None, estimate: DecodeEstimate) -> StepSplit:
    """Divide one `step` message (see `StepSplit`); `prev_t1` is the previous step's `t1`."""
    t0, t1 = float(step["t0"]), float(step["t1"])
    start = t0 if prev_t1 is None else max(t0, prev_t1)
    span = max(0.0, t1 - start)
    items: dict[int, tuple[str, int, int]] = {}
    decodes = prompt = 0
    for it in step.get("items") or ():
        if not isinstance(it, dict) or "uid" not in it:
            continue
        kind, a, b = it.get("kind", "decode"), int(it.get("start", 0)), int(it.get("end", 1))
        items[int(it["uid"])] = (kind, a, b)
        if kind == "decode":
            decodes += 1
        else:
            prompt += max(1, b - a)
    if not prompt:
        decode_part = span
    elif not decodes:
        decode_part = 0.0
    else:
        est = estimate(decodes)
        if est is None:  # no decode-only step yet: by tokens
            est = span * decodes / (decodes + prompt)
        decode_part = min(span, est)
    cost: dict[int, float] = {}
    rest = span - decode_part
    for uid, (kind, a, b) in items.items():
        if kind == "decode":
            cost[uid] = decode_part / decodes
        else:
            cost[uid] = rest * max(1, b - a) / prompt
    queue = step.get("queue") or {}
    return StepSplit(
        step=int(step.get("step", -1)),
        t0=t0,
        t1=t1,
        start=start,
        span=span,
        items=items,
        decodes=decodes,
        prompt_tokens=prompt,
        decode_part=decode_part,
        cost=cost,
        retracted=frozenset(int(u) for u in step.get("retracted") or ()),
        reason=queue.get("waiting_reason") or UNKNOWN_REASON,
    )


@dataclass(frozen=True, slots=True)
class Charge:
    """Seconds of one request's wait charged to one cause over a run of consecutive steps
    `first_step` .. `last_step`. `part` is a Delay part; `reason` the waiting reason (queue),
    `uid` the other request (by), `kind` the work (`prompt`, `recompute`, `decode`) and
    `start`:`end` its token range, where the work was a prompt or a recompute."""

    part: str
    seconds: float
    first_step: int
    last_step: int
    steps: int
    reason: str | None = None
    uid: int | None = None
    kind: str | None = None
    start: int | None = None
    end: int | None = None

    def what(self) -> str:
        """The cause in words: "request 9's prompt [512:768]", "own decode", "waiting (kv)"."""
        span = f" [{self.start}:{self.end}]" if self.start is not None else ""
        if self.part == "by":
            return f"request {self.uid}'s {self.kind}{span}"
        if self.part == "queue":
            return f"waiting ({self.reason})"
        if self.part == "host":
            return "between steps"
        if self.part == "retracted":
            return f"own recompute{span}"
        return f"own {self.kind}{span}"

    def describe(self) -> str:
        """E.g. "31 ms request 9's prompt [512:768] in steps 812–814"."""
        if self.first_step == self.last_step:
            steps = f"step {self.first_step}"
        elif self.steps == self.last_step - self.first_step + 1:
            steps = f"steps {self.first_step}–{self.last_step}"
        else:
            steps = f"{self.steps} steps in {self.first_step}–{self.last_step}"
        return f"{describe_seconds(self.seconds)} {self.what()} in {steps}"


@dataclass(frozen=True, slots=True)
class GapDelay:
    """The wait before one of a request's tokens (`index` 0: queued to its first token), by
    cause. `stall`: a step ran without it in between (instrumentation.metrics); `ongoing`: no
    token yet ends it (the request is still waiting for it)."""

    uid: int
    index: int
    t_start: float
    t_end: float
    first_step: int | None
    last_step: int | None
    stall: bool
    ongoing: bool
    charges: tuple[Charge, ...]

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start

    @property
    def waited(self) -> float:
        """Of it, the seconds spent waiting for admission."""
        return sum(c.seconds for c in self.charges if c.part == "queue")

    def causes(self) -> list[Charge]:
        """One Charge per cause (its runs added up), largest first."""
        runs: dict[tuple, list[Charge]] = {}
        for c in self.charges:
            runs.setdefault((c.part, c.reason, c.uid, c.kind), []).append(c)
        return sorted((_merged(rs) for rs in runs.values()), key=lambda c: -c.seconds)

    def main(self) -> Charge | None:
        """The largest cause, every run of it added up."""
        causes = self.causes()
        return causes[0] if causes else None

    def describe(self) -> str:
        """E.g. "38 ms: 31 ms request 9's prompt [512:768] in steps 812–814, 7 ms own decode
        in step 815"."""
        parts = sorted(self.charges, key=lambda c: -c.seconds)
        text = ", ".join(c.describe() for c in parts if c.seconds > 0) or "nothing"
        return f"{describe_seconds(self.seconds)}: {text}"


def _merged(runs: list[Charge]) -> Charge:
    c = runs[0]
    starts = [r.start for r in runs if r.start is not None]
    ends = [r.end for r in runs if r.end is not None]
    return Charge(
        c.part, sum(r.seconds for r in runs), min(r.first_step for r in runs),
        max(r.last_step for r in runs), sum(r.steps for r in runs), c.reason, c.uid, c.kind,
        min(starts) if starts else None, max(ends) if ends else None,
    )  # fmt: skip


def describe_seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


@dataclass(frozen=True, slots=True)
class TokenWait:
    """What the ledger tells `on_token`: the wait before token `index` of request `uid`, by
    part (`delay`), and of it the seconds charged to other requests' prompt work (chunks,
    prefills and recomputes: the decode interference SGLang's and vLLM's users ask about)."""

    uid: int
    index: int
    seconds: float
    delay: Delay
    by_prompt: float


class _Run:
    """A Charge being built: extended while the same cause recurs in consecutive steps."""

    __slots__ = ("key", "seconds", "first", "last", "steps", "start", "end")

    def __init__(self, key: tuple, step: int, seconds: float, rng: tuple[int, int] | None) -> None:
        self.key, self.seconds, self.first, self.last, self.steps = key, seconds, step, step, 1
        self.start, self.end = rng if rng is not None else (None, None)

    def charge(self) -> Charge:
        part, reason, uid, kind = self.key
        return Charge(part, self.seconds, self.first, self.last, self.steps, reason, uid, kind,
                      self.start, self.end)  # fmt: skip


class _Req:
    """The ledger's state of one request in flight."""

    __slots__ = (
        "uid", "t_queued", "cursor", "running", "done", "pending", "by_prompt", "tokens",
        "t_last", "step_last", "runs", "open", "gaps", "first_step",
    )  # fmt: skip

    def __init__(self, uid: int, t_queued: float, detail: bool) -> None:
        self.uid, self.t_queued, self.cursor = uid, t_queued, t_queued
        self.running = False
        self.done = Delay()  # up to its last token
        self.pending = Delay()  # since its last token (or queued)
        self.by_prompt = 0.0  # of `pending.by`, the seconds from others' prompt work
        self.tokens = 0
        self.t_last = t_queued
        self.step_last: int | None = None
        self.first_step: int | None = None
        self.runs: list[_Run] | None = [] if detail else None
        self.open: dict[tuple, _Run] = {}
        self.gaps: list[GapDelay] = []

    def note(self, key: tuple, step: int, seconds: float, rng: tuple[int, int] | None) -> None:
        """Detail: `seconds` of this gap went to `key` in `step`."""
        if self.first_step is None:
            self.first_step = step
        run = self.open.get(key)
        if run is not None and run.last >= step - 1:
            run.seconds += seconds
            run.steps += run.last != step
            run.last = step
            if rng is not None:
                run.start = rng[0] if run.start is None else min(run.start, rng[0])
                run.end = rng[1] if run.end is None else max(run.end, rng[1])
            return
        run = self.open[key] = _Run(key, step, seconds, rng)
        self.runs.append(run)  # type: ignore[union-attr]

    def close_gap(self, t_end: float, step: int | None, ongoing: bool) -> GapDelay:
        stall = (
            self.tokens > 0 and not ongoing and self.step_last is not None and step is not None
            and stalled_between(self.step_last, step)
        )  # fmt: skip
        charges = tuple(r.charge() for r in self.runs or ())
        return GapDelay(self.uid, self.tokens, self.t_last, t_end, self.first_step, step,
                        stall, ongoing, charges)  # fmt: skip


def _is_time(t: object) -> bool:
    return isinstance(t, int | float) and not isinstance(t, bool)


def _work(kind: str) -> str:
    return "decode" if kind == "decode" else ("recompute" if kind == "recompute" else "prompt")


class DelayLedger:
    """Feed it every message of a stream, in order (`apply`); it names each request's delay.

    `apply` returns a request's final `Delay` when the message ends it (`finished`, `aborted`,
    `rejected`). `delay(uid)` is a request's delay so far. With `detail`, each request also keeps
    its `GapDelay`s (`gaps(uid)`), the wait before each of its tokens by cause and step, until it
    ends (the fold keeps them with its record); without, the ledger keeps a few numbers per
    request in flight. `on_token` is called with each token's `TokenWait`.
    """

    def __init__(
        self, *, detail: bool = False, on_token: Callable[[TokenWait], None] | None = None
    ) -> None:
        self.detail = detail
        self.on_token = on_token
        self.estimate = DecodeEstimate()
        self.live: dict[int, _Req] = {}
        self.last: StepSplit | None = None
        self._step: int | None = None  # the step the next token messages belong to
        self.ended_gaps: dict[int, list[GapDelay]] = {}  # detail: popped by the fold at the end

    def reset(self) -> None:
        self.__init__(detail=self.detail, on_token=self.on_token)  # type: ignore[misc]

    # -- folding ---------------------------------------------------------------------------
    def apply(self, msg: Message) -> Delay | None:
        """Fold one message; a message that is not the protocol's (no times, no uid) is let
        through untouched: the publisher runs this on everything it sends."""
        kind = msg.get("type")
        if kind == "step":
            if _is_time(msg.get("t0")) and _is_time(msg.get("t1")):
                self.on_step(msg)
        elif kind == "token":
            if isinstance(msg.get("uid"), int) and _is_time(msg.get("t")):
                self.on_token_msg(msg)
        elif kind == "request":
            if isinstance(msg.get("uid"), int):
                return self.on_request(msg)
        elif kind == "hello":
            self.reset()
            for step in (msg.get("history") or {}).get("steps") or ():
                if _is_time(step.get("t0")) and _is_time(step.get("t1")):
                    self.on_step(step)  # no request to charge: the estimate learns the run's steps
        return None

    def annotate(self, msg: Message) -> bool:
        """Fold `msg`; if it ends a request, add its `delay` object. True when it did."""
        delay = self.apply(msg)
        if delay is None:
            return False
        msg["delay"] = delay.to_dict()
        return True

    def on_step(self, msg: Message) -> None:
        prev = self.last
        sp = split_step(msg, None if prev is None else prev.t1, self.estimate)
        for r in self.live.values():
            self._charge(r, sp)
        if sp.decodes and not sp.prompt_tokens:
            self.estimate.add(sp.decodes, sp.span)
        self.last = sp
        self._step = sp.step

    def on_token_msg(self, msg: Message) -> None:
        r = self.live.get(int(msg["uid"]))
        if r is None:
            return
        t = float(msg["t"])
        if self.on_token is not None:
            self.on_token(TokenWait(r.uid, r.tokens, t - r.t_last, r.pending.copy(), r.by_prompt))
        if r.runs is not None:
            r.gaps.append(r.close_gap(t, self._step, False))
            r.runs, r.open, r.first_step = [], {}, None
        r.done.absorb(r.pending)
        r.by_prompt = 0.0
        r.tokens += 1
        r.t_last, r.step_last = t, self._step

    def on_request(self, msg: Message) -> Delay | None:
        uid, event = int(msg["uid"]), msg.get("event")
        if event == "queued":
            t = msg.get("t")
            if isinstance(t, int | float) and uid not in self.live:
                r = self.live[uid] = _Req(uid, float(t), self.detail)
                if self.last is not None and r.cursor < self.last.t1:
                    self._arrived_during(r, self.last)
            return None
        if event not in ENDED_STATES:
            return None
        r = self.live.pop(uid, None)
        if r is None:
            return None
        delay = r.done.copy() if r.tokens else Delay()
        if not r.tokens:  # ended before a token: covered up to its last step
            delay.add(r.pending)
        if r.runs is not None:
            if r.runs and not r.tokens:
                r.gaps.append(r.close_gap(r.cursor, self._step, True))
            self.ended_gaps[uid] = r.gaps
        return delay

    # -- reading -------------------------------------------------------------------------
    def pop_gaps(self, uid: int) -> list[GapDelay]:
        """Detail: an ended request's waits, handed over (the ledger forgets them)."""
        return self.ended_gaps.pop(uid, [])

    def delay(self, uid: int) -> Delay | None:
        """A request in flight: its delay so far, up to the last step (its current wait
        included)."""
        r = self.live.get(uid)
        if r is None:
            return None
        d = r.done.copy()
        d.add(r.pending)
        return d

    def gaps(self, uid: int) -> list[GapDelay]:
        """Detail: the request's waits token by token, the current one last (`ongoing`)."""
        r = self.live.get(uid)
        if r is None:
            return list(self.ended_gaps.get(uid, ()))
        out = list(r.gaps)
        if r.runs:
            out.append(r.close_gap(r.cursor, self._step, True))
        return out

    # -- charging ------------------------------------------------------------------------
    def _arrived_during(self, r: _Req, sp: StepSplit) -> None:
        """Queued while step `sp` ran (with overlap, after it was scheduled): it waits for that
        step's work."""
        portion = sp.t1 - r.cursor
        inside = min(portion, sp.t1 - sp.start)
        if portion > inside:  # before that step's span: no step ran
            self._add(r, ("host", None, None, None), sp.step, portion - inside, None)
        if inside > 0 and sp.span > 0:
            self._by(r, sp, sp.cost, inside / sp.span, skip=None)
        r.cursor = sp.t1

    def _charge(self, r: _Req, sp: StepSplit) -> None:
        c = r.cursor
        if sp.t0 > c:  # nothing ran between its previous step (or its arrival) and this one
            self._add(r, ("host", None, None, None), sp.step, sp.t0 - c, None)
            c = sp.t0
        portion = sp.t1 - max(c, sp.start)
        if sp.start > c:  # cannot happen on one clock; kept whole by charging it to host
            self._add(r, ("host", None, None, None), sp.step, sp.start - c, None)
        r.cursor = max(c, sp.t1)
        uid = r.uid
        item = sp.items.get(uid)
        if item is not None:
            r.running = True
        elif uid in sp.retracted:
            r.running = False
        if portion <= 0 or sp.span <= 0:
            return
        f = portion / sp.span
        if item is not None:
            kind, a, b = item
            if kind == "decode":
                own = sp.decode_part * f
                self._add(r, ("own", None, None, "decode"), sp.step, own, None)
                if (
                    sp.prompt_tokens
                ):  # the other decodes are its batch: only the prompts are others'
                    self._by(r, sp, sp.cost, f, skip=uid, prompts_only=True)
                return
            share = sp.token_share()
            part = "retracted" if kind == "recompute" else "own"
            self._add(r, (part, None, None, _work(kind)), sp.step, share[uid] * f, (a, b))
            self._by(r, sp, share, f, skip=uid)
            return
        if not r.running and r.t_queued <= sp.t0:  # in the queue when the step was scheduled
            self._add(r, ("queue", sp.reason, None, None), sp.step, portion, None)
            return
        # admitted but left out of the step, or arrived after it was scheduled
        self._by(r, sp, sp.cost, f, skip=None)

    def _by(self, r: _Req, sp: StepSplit, shares: dict[int, float], f: float,
            skip: int | None, prompts_only: bool = False) -> None:  # fmt: skip
        by = r.pending.by
        for u, s in shares.items():
            if u == skip or s <= 0:
                continue
            kind, a, b = sp.items[u]
            if kind == "decode":
                if prompts_only:
                    continue
            else:
                r.by_prompt += s * f
            s *= f
            by[u] = by.get(u, 0.0) + s
            if r.runs is not None:
                work = _work(kind)
                r.note(("by", None, u, work), sp.step, s, None if work == "decode" else (a, b))

    def _add(self, r: _Req, key: tuple, step: int, seconds: float,
             rng: tuple[int, int] | None) -> None:  # fmt: skip
        part = key[0]
        p = r.pending
        if part == "own":
            p.own += seconds
        elif part == "queue":
            p.queue[key[1]] = p.queue.get(key[1], 0.0) + seconds
        elif part == "host":
            p.host += seconds
        else:
            p.retracted += seconds
        if r.runs is not None:
            r.note(key, step, seconds, None if key[3] == "decode" else rng)


def delays_of(messages: Iterable[Message], *, recompute: bool = True) -> dict[int, Delay]:
    """Every ended request's delay in a recording (or any message list), computed from its
    steps and events; `recompute=False` takes a `delay` the end event already carries."""
    ledger = DelayLedger()
    out: dict[int, Delay] = {}
    for msg in messages:
        delay = ledger.apply(msg)
        if delay is not None:
            given = msg.get("delay")
            out[int(msg["uid"])] = (
                Delay.from_dict(given) if not recompute and isinstance(given, dict) else delay
            )
    return out
