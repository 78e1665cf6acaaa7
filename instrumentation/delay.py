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
span is divided (instrumentation.step_cost):

- a request left out of the step (or that arrived while it ran) is charged each piece's *cost
  split* share: the step's decodes together cost what a decode-only step of as many decodes
  costs in this run (the running median of its decode-only steps of that batch size, never more
  than the span), shared equally; the prompt pieces (chunk, prefill, recompute) share the rest by
  tokens.
- a decode in the step keeps the decode part as `own` (the other decodes are its batch); only
  the rest, what the prompt pieces riding along added, is charged to them.
- a prompt piece in the step is charged by tokens (a decode counts one token): its share is
  `own` (or `retracted`), the other pieces' shares go to their requests.

The parts add up to the latency by construction: each request keeps a cursor on the step clock,
and every step moves it to the step's end, charging what it passed to one part. A request that
ended without a token (aborted while waiting or prefilling) is covered up to its last step.
Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from instrumentation.metrics import stalled_between
from instrumentation.protocol import ENDED_STATES
from instrumentation.step_cost import DecodeEstimate, StepSplit, split_step
from instrumentation.waits import HOST, OWN_DECODE, GapDelay, Key, WaitLog

__all__ = ["Delay", "DelayLedger", "TokenWait", "delays_of"]

Message = dict[str, Any]


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
        other.own = 0.0
        if other.host:
            self.host += other.host
            other.host = 0.0
        if other.retracted:
            self.retracted += other.retracted
            other.retracted = 0.0
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


class _Req:
    """The ledger's state of one request in flight: `done` up to its last token, `pending`
    since (or since it was queued), `cursor` how far its lifetime has been charged."""

    __slots__ = ("uid", "t_queued", "cursor", "running", "done", "pending", "by_prompt",
                 "tokens", "t_last", "step_last", "log")  # fmt: skip

    def __init__(self, uid: int, t_queued: float, detail: bool) -> None:
        self.uid, self.t_queued, self.cursor = uid, t_queued, t_queued
        self.running = False  # admitted (in a step since it was queued or retracted)
        self.done = Delay()
        self.pending = Delay()
        self.by_prompt = 0.0  # of `pending.by`, the seconds from others' prompt work
        self.tokens = 0
        self.t_last = t_queued
        self.step_last: int | None = None
        self.log: WaitLog | None = WaitLog(uid) if detail else None


def _is_time(t: object) -> bool:
    return type(t) is float or type(t) is int


def _work(kind: str) -> str:
    return "decode" if kind == "decode" else ("recompute" if kind == "recompute" else "prompt")


class DelayLedger:
    """Feed it every message of a stream, in order (`apply`); it names each request's delay.

    `apply` returns a request's final `Delay` when the message ends it (`finished`, `aborted`,
    `rejected`); `delay(uid)` is one in flight's so far. With `detail`, each request also keeps
    its waits token by token (`gaps(uid)`, instrumentation.waits), handed over when it ends
    (`pop_gaps`); without, a few numbers per request in flight. `on_token` is called with each
    token's `TokenWait`.
    """

    def __init__(
        self, *, detail: bool = False, on_token: Callable[[TokenWait], None] | None = None
    ) -> None:
        self.detail = detail
        self.on_token = on_token
        self.reset()

    def reset(self) -> None:
        self.estimate = DecodeEstimate()
        self.live: dict[int, _Req] = {}
        self.last: StepSplit | None = None
        self._step: int | None = None  # the step the next token messages belong to
        self._ended: dict[int, list[GapDelay]] = {}

    # -- folding ---------------------------------------------------------------------------
    def apply(self, msg: Message) -> Delay | None:
        """Fold one message; one that is not the protocol's (no times, no uid) is let through
        untouched: the publisher runs this on everything it sends."""
        kind = msg.get("type")
        if kind == "token":  # the most frequent: a request not in flight here costs one lookup
            r = self.live.get(msg.get("uid"))  # type: ignore[arg-type]
            if r is not None and _is_time(msg.get("t")):
                self._token(r, msg["t"])
        elif kind == "step":
            if _is_time(msg.get("t0")) and _is_time(msg.get("t1")):
                self.on_step(msg)
        elif kind == "request":
            if type(msg.get("uid")) is int:
                return self.on_request(msg)
        elif kind == "hello":
            self.reset()
            for step in (msg.get("history") or {}).get("steps") or ():
                if _is_time(step.get("t0")) and _is_time(step.get("t1")):
                    self.on_step(step)  # nothing to charge: the estimate learns the run's steps
        return None

    def annotate(self, msg: Message) -> bool:
        """Fold `msg`; if it ends a request, add its `delay` object. True when it did."""
        delay = self.apply(msg)
        if delay is None:
            return False
        msg["delay"] = delay.to_dict()
        return True

    def on_step(self, msg: Message) -> None:
        sp = split_step(msg, None if self.last is None else self.last.t1, self.estimate)
        n, t0, t1, start, span = sp.step, sp.t0, sp.t1, sp.start, sp.span
        items, retracted, pure = sp.items, sp.retracted, not sp.prompt_tokens
        queue_key: Key = ("queue", sp.reason, None, None)
        for r in self.live.values():
            c = r.cursor
            if c >= t1:
                continue
            p = r.pending
            if c < start:  # nothing ran between its last step (or its arrival) and this one
                p.host += start - c
                if r.log is not None:
                    r.log.note(HOST, n, start - c)
                c = start
            portion = t1 - c
            r.cursor = t1
            item = items.get(r.uid)
            if item is None and retracted and r.uid in retracted:
                r.running = False
            if portion <= 0:  # a step of no time (a clock's tick)
                r.running = r.running or item is not None
                continue
            if item is None:
                if not r.running and r.t_queued <= t0:  # in the queue when it was scheduled
                    q = p.queue
                    q[sp.reason] = q.get(sp.reason, 0.0) + portion
                    if r.log is not None:
                        r.log.note(queue_key, n, portion)
                else:  # admitted but left out, or arrived after it was scheduled
                    self._by(r, sp, sp.cost(), portion / span, None, False)
                continue
            r.running = True
            if item["kind"] == "decode":
                if pure:  # the common step: its decode, batched with others
                    p.own += portion
                    if r.log is not None:
                        r.log.note(OWN_DECODE, n, portion)
                    continue
                f = portion / span
                p.own += sp.decode_part * f
                if r.log is not None:
                    r.log.note(OWN_DECODE, n, sp.decode_part * f)
                # the other decodes are its batch: only the prompt pieces are others' work
                self._by(r, sp, sp.cost(), f, r.uid, True)
                continue
            self._in_prompt(r, sp, item, portion / span)
        if sp.decodes and pure:
            self.estimate.add(sp.decodes, span)
        self.last = sp
        self._step = n

    def _token(self, r: _Req, t: float) -> None:
        p = r.pending
        if self.on_token is not None:
            self.on_token(TokenWait(r.uid, r.tokens, t - r.t_last, p.copy(), r.by_prompt))
        if r.log is not None:
            stall = (
                r.step_last is not None
                and self._step is not None
                and stalled_between(r.step_last, self._step)
            )
            r.log.close(r.t_last, t, self._step, stall)
        r.done.absorb(p)
        r.by_prompt = 0.0
        r.tokens += 1
        r.t_last, r.step_last = t, self._step

    def on_request(self, msg: Message) -> Delay | None:
        uid, event = msg["uid"], msg.get("event")
        if event == "queued":
            t = msg.get("t")
            if _is_time(t) and uid not in self.live:
                r = self.live[uid] = _Req(uid, float(t), self.detail)  # type: ignore[arg-type]
                if self.last is not None and r.cursor < self.last.t1:
                    self._arrived_during(r, self.last)
            return None
        if event not in ENDED_STATES:
            return None
        r = self.live.pop(uid, None)
        if r is None:
            return None
        delay = r.done
        if not r.tokens:  # ended before a token: covered up to its last step
            delay.add(r.pending)
        if r.log is not None:
            if not r.tokens and r.log.runs:
                r.log.close(r.t_last, r.cursor, self._step, False, ongoing=True)
            self._ended[uid] = r.log.gaps()
        return delay

    # -- reading -------------------------------------------------------------------------
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
            return list(self._ended.get(uid, ()))
        if r.log is None:
            return []
        return r.log.gaps((r.t_last, r.cursor, self._step))

    def pop_gaps(self, uid: int) -> list[GapDelay]:
        """Detail: an ended request's waits, handed over (the ledger forgets them)."""
        return self._ended.pop(uid, [])

    # -- charging ------------------------------------------------------------------------
    def _arrived_during(self, r: _Req, sp: StepSplit) -> None:
        """Queued while step `sp` ran (with overlap, after it was scheduled): it waits for that
        step's work."""
        portion = sp.t1 - r.cursor
        inside = min(portion, sp.span)
        if portion > inside:  # before that step's span: no step ran
            r.pending.host += portion - inside
            if r.log is not None:
                r.log.note(HOST, sp.step, portion - inside)
        if inside > 0:
            self._by(r, sp, sp.cost(), inside / sp.span, None, False)
        r.cursor = sp.t1

    def _in_prompt(self, r: _Req, sp: StepSplit, item: Message, f: float) -> None:
        """A prompt piece of its own in the step: charged by tokens."""
        share = sp.token_share()
        s = share[r.uid] * f
        kind = item["kind"]
        if kind == "recompute":
            r.pending.retracted += s
        else:
            r.pending.own += s
        if r.log is not None:
            part = "retracted" if kind == "recompute" else "own"
            r.log.note((part, None, None, _work(kind)), sp.step, s, item["start"], item["end"])
        self._by(r, sp, share, f, r.uid, False)

    def _by(self, r: _Req, sp: StepSplit, shares: dict[int, float], f: float,
            skip: int | None, prompts_only: bool) -> None:  # fmt: skip
        by = r.pending.by
        items = sp.items
        for u, s in shares.items():
            if u == skip or s <= 0:
                continue
            item = items[u]
            kind = item["kind"]
            if kind == "decode":
                if prompts_only:
                    continue
            s *= f
            if kind != "decode":
                r.by_prompt += s
            by[u] = by.get(u, 0.0) + s
            if r.log is not None:
                work = _work(kind)
                if work == "decode":
                    r.log.note(("by", None, u, work), sp.step, s)
                else:
                    r.log.note(("by", None, u, work), sp.step, s, item["start"], item["end"])


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
