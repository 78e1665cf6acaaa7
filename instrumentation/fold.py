"""The one fold of the protocol's message stream into steps and requests.

Everything that reads the stream folds it here: the server's history (what a late client's
`hello` carries), the dashboard's store, the trace export, the sweep's summary and the stall
benchmark (`/metrics` keeps only counters, computed with the same instrumentation.metrics). So
they agree on what a request's TTFT, inter-token latency and worst stall are. Pure Python, no
torch: the dashboard imports it.

Definitions (docs/protocol.md, "Metrics"; every figure is computed by instrumentation.metrics):
- a request's token times are the `t` of its `token` messages (the producing step's `t1`), and
  its token steps the numbers of the steps that sampled them (a step's tokens follow its `step`
  message);
- ITL is the gap between consecutive tokens of one request; TTFT is first token minus queued;
- a *stall* is a gap between two tokens of a request during which at least one step ran without
  it (decode skipped); a slow step that included the request is not a stall;
- output tokens per second: tokens sampled over the span from the first step's `t0` to the last
  step's `t1`.

`Summary` is the headline: `Fold.summary()` for everything folded, `summarize(messages)` for a
whole recording, `summarize_steps(steps, requests)` for a window of steps (what a page has in
view), all through one function, so each says the same thing of the same steps.

The fold also checks the v1.1 delivery facts: `seq` grows by one per broadcast (a jump is a
`Gap`: messages were lost), and `hello.engine.instance` names the engine (another instance is a
restart: everything recorded before belongs to the old engine and is dropped).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from instrumentation.delay import Delay, DelayLedger
from instrumentation.metrics import gaps, percentile, request_metrics
from instrumentation.protocol import (
    BROADCAST_TYPES,
    ENDED_STATES,
)
from instrumentation.request_record import Gap, RequestRecord, record_from_dict
from instrumentation.steps import (  # noqa: F401 (the step readers, importable from here too)
    Stall,
    samples,
    stalls,
    step_recompute,
    step_tokens,
    token_steps,
)

__all__ = [
    "ENDED_STATES",
    "Fold",
    "Gap",
    "RequestRecord",
    "Stall",
    "Summary",
    "percentile",
    "request_metrics",
    "samples",
    "step_recompute",
    "stalls",
    "summarize",
    "summarize_steps",
]

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Summary:
    """The headline figures of a run or of a window of its steps: the page's metric row, replay
    compare's table, the sweep's summary row. `first_step` .. `last_step` (step numbers) and
    `steps` say which steps it covers; its requests are those with a token in them."""

    requests: int
    finished: int
    aborted: int
    rejected: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_p999_s: float | None
    worst_stall_s: float | None
    worst_stall_uid: int | None
    output_tok_s: float | None
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    # prompt tokens served by the prefix cache over prompt tokens of the admitted requests
    prefix_hit_rate: float | None = None
    retractions: int = 0  # v1.3: requests sent back to the queue, to be recomputed
    recomputed_tokens: int = 0  # tokens computed again for them (not in prompt_tokens)


class Fold:
    """Feed every message of one connection (or one recording) in order with `apply()`.

    It keeps the last `max_steps` steps (None: all), every request in flight, and ended requests
    up to `max_ended` of them and `max_ended_bytes` of their token times and text.
    """

    def __init__(
        self,
        *,
        max_steps: int | None = 2000,
        max_ended: int = 2000,
        max_ended_bytes: int = 32 * 2**20,
        config: dict[str, Any] | None = None,
        delays: bool = False,
    ) -> None:
        self.steps: deque[Message] = deque(maxlen=max_steps)
        self.config: dict[str, Any] = dict(config or {})
        self.engine: dict[str, Any] | None = None
        self.instance: str | None = None
        self.seq: int | None = None  # the last broadcast folded
        self.num_steps = 0  # steps folded since the start (or the last restart)
        self.lost = 0  # broadcasts missed in gaps, since the start (or the last restart)
        self.gaps = 0
        self.restarts = 0
        self._live: dict[int, RequestRecord] = {}
        self._ended: OrderedDict[int, RequestRecord] = OrderedDict()
        self._ended_bytes = 0
        self._max_ended = max_ended
        self._max_ended_bytes = max_ended_bytes
        # every request's sampled tokens and prompt tokens, for the summary (not bounded)
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.retractions = 0
        self.recomputed_tokens = 0
        self._first_t0: float | None = None
        self._last_t1: float | None = None
        self._first_step: int | None = None
        self._last_step: int | None = None  # the step the next `token` messages belong to
        # `delays`: name each request's delay token by token here (else its end event's)
        self.ledger = DelayLedger(detail=True) if delays else None

    # -- folding -------------------------------------------------------------------------
    def apply(self, msg: Message) -> Gap | None:
        """Fold one message; returns the gap it revealed, if its `seq` skipped some."""
        kind = msg.get("type")
        if kind == "hello":
            self.load_hello(msg)
            return None
        gap = None
        seq = msg.get("seq")
        if kind in BROADCAST_TYPES and isinstance(seq, int):
            if self.seq is not None:
                if seq <= self.seq:  # already folded (history overlapping the stream)
                    return None
                if seq > self.seq + 1:
                    gap = Gap(self.seq + 1, seq)
                    self.gaps += 1
                    self.lost += gap.lost
            self.seq = seq
        computed = None if self.ledger is None else self.ledger.apply(msg)
        if kind == "step":
            self._on_step(msg)
        elif kind == "token":
            self._on_token(msg)
        elif kind == "request":
            self._on_request(msg, computed)
        elif kind == "config":
            self.config = {k: v for k, v in msg.items() if k not in ("type", "id", "t", "seq")}
        return gap

    def load_hello(self, hello: Message) -> bool:
        """Start from a server's `hello`; True if it names another engine instance than the
        one folded so far (a restart: the old records are dropped)."""
        engine = dict(hello.get("engine") or {})
        instance = engine.get("instance")
        restarted = self.instance is not None and instance != self.instance
        if restarted:
            self.restarts += 1
            self.lost = self.gaps = 0
        self.steps.clear()
        self._live.clear()
        self._ended.clear()
        self._ended_bytes = 0
        self.engine, self.instance = engine, instance
        if self.ledger is not None:
            self.ledger.apply(hello)
        self.config = dict(hello.get("config") or {})
        seq = hello.get("seq")
        self.seq = seq if isinstance(seq, int) else None
        history = hello.get("history") or {}
        steps = [s for s in history.get("steps") or [] if isinstance(s, dict)]
        self.steps.extend(steps)
        self.num_steps = len(self.steps)
        self.prompt_tokens = self.output_tokens = 0
        self.retractions = self.recomputed_tokens = 0
        self._first_t0 = self._last_t1 = None
        self._first_step = self._last_step = None
        for step in steps:
            self._count(step)
        for row in history.get("requests") or []:
            rec = record_from_dict(row)
            if rec.ended:
                self._remember_ended(rec)
            else:
                self._live[rec.uid] = rec
        return restarted

    def _count(self, step: Message) -> None:
        t0, t1 = step.get("t0"), step.get("t1")
        if self._first_t0 is None and isinstance(t0, int | float):
            self._first_t0 = float(t0)
        if isinstance(t1, int | float):
            self._last_t1 = float(t1)
        number = step.get("step")
        if isinstance(number, int):
            if self._first_step is None:
                self._first_step = number
            self._last_step = number
        prompt, output = step_tokens(step)
        self.prompt_tokens += prompt
        self.output_tokens += output
        retracted, recomputed = step_recompute(step)
        self.retractions += retracted
        self.recomputed_tokens += recomputed

    def _on_step(self, msg: Message) -> None:
        self.steps.append(msg)
        self.num_steps += 1
        self._count(msg)

    def _on_token(self, msg: Message) -> None:
        rec = self._live.get(msg["uid"])
        if rec is None:  # its queued event predates what we saw; nothing to attach to
            return
        rec.token_times.append(msg["t"])
        # a step's tokens follow its `step` message (docs/protocol.md), so this is its step;
        # -1 only in a stream that is not the protocol's (tokens before any step)
        rec.token_steps.append(-1 if self._last_step is None else self._last_step)
        rec.t_last_token = msg["t"]
        rec.pieces.append(msg.get("text", ""))
        rec.output_len += 1

    def _on_request(self, msg: Message, delay: Delay | None = None) -> None:
        uid, event, t = msg["uid"], msg["event"], msg.get("t")
        rec = self._live.get(uid)
        if rec is None:
            if uid in self._ended:  # a late duplicate for an ended request changes nothing
                return
            rec = self._live[uid] = RequestRecord(uid)
        if event == "queued":
            rec.t_queued = t
            rec.prompt_len = msg.get("prompt_len", rec.prompt_len)
            rec.max_tokens = msg.get("max_tokens", rec.max_tokens)
            rec.source = msg.get("source", rec.source)
        elif event == "admitted":
            rec.state = "running"
            if not msg.get("recompute"):  # a readmission keeps the first admission's figures
                rec.t_admitted = t
                rec.cached_len = msg.get("cached_len", rec.cached_len)
        elif event == "retracted":
            rec.state = "waiting"
            rec.retractions += 1
        elif event == "first_token":
            rec.t_first_token = t
            if rec.state == "waiting":
                rec.state = "running"
        elif event in ENDED_STATES:
            rec.state = event
            rec.t_finished = t
            rec.finish_reason = msg.get("finish_reason")
            rec.kv_after = msg.get("kv", rec.kv_after)
            rec.message = msg.get("message")
            if "output_len" in msg:
                rec.output_len = msg["output_len"]
            if "text" in msg:
                rec.final_text = msg["text"]
            rec.cached_metrics = rec.metrics()
            given = msg.get("delay")  # the server's, from the whole stream: preferred
            rec.delay = Delay.from_dict(given) if isinstance(given, dict) else delay
            if self.ledger is not None:
                rec.delay_gaps = self.ledger.pop_gaps(uid)
            rec.final_text = rec.text
            rec.pieces = []
            del self._live[uid]
            self._remember_ended(rec)

    def _remember_ended(self, rec: RequestRecord) -> None:
        self._ended[rec.uid] = rec
        self._ended_bytes += rec.approx_bytes()
        while self._ended and (
            len(self._ended) > self._max_ended or self._ended_bytes > self._max_ended_bytes
        ):
            _, old = self._ended.popitem(last=False)
            self._ended_bytes -= old.approx_bytes()

    # -- reading -------------------------------------------------------------------------
    def get(self, uid: int) -> RequestRecord | None:
        return self._live.get(uid) or self._ended.get(uid)

    def requests(self) -> list[RequestRecord]:
        """Recently ended requests, then live ones, each group oldest first."""
        return [*self._ended.values(), *self._live.values()]

    def live_requests(self) -> list[RequestRecord]:
        return list(self._live.values())

    @property
    def waiting_reason(self) -> str | None:
        """Why the head of the waiting queue was not admitted in the latest step (v1.3):
        `budget`, `kv`, `max_running` or `reserved`; None when nothing waited. Admission is
        FIFO, so every waiting request waits behind the head, for this reason."""
        if not self.steps:
            return None
        return (self.steps[-1].get("queue") or {}).get("waiting_reason")

    @property
    def ended_bytes(self) -> int:
        return self._ended_bytes

    def history(self) -> dict[str, Any]:
        """`hello.history`: the kept steps and request records."""
        return {
            "steps": list(self.steps),
            "requests": [rec.to_dict() for rec in self.requests()],
        }

    def summary(self) -> Summary:
        """Headline figures over the remembered requests and the steps since the start."""
        span = None
        if self._first_t0 is not None and self._last_t1 is not None:
            span = self._last_t1 - self._first_t0
        return _summary(
            self.requests(),
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            span=span,
            steps=(self.num_steps, self._first_step, self._last_step),
            pressure=(self.retractions, self.recomputed_tokens),
        )


def summarize(messages: Iterable[Message]) -> Summary:
    """Fold a whole recording (e.g. a `--trace` JSONL) and summarize it; nothing is dropped."""
    fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62)
    for msg in messages:
        fold.apply(msg)
    return fold.summary()


def summarize_steps(steps: Sequence[Message], requests: Iterable[Message]) -> Summary:
    """The same headline over a window of steps (what a page has in view), from the steps and
    the requests' records (`RequestRecord.to_dict`, metrics not needed). Its requests are those
    alive in the window (queued before its end, not ended before its start); a request's tokens
    are its sampling items in the window, and its TTFT counts if its first token is among them.
    Over every step of a recording it equals `summarize` of the recording."""
    recs: dict[int, RequestRecord] = {}
    rows = {int(r["uid"]): r for r in requests}
    if steps:
        lo, hi = float(steps[0]["t0"]), float(steps[-1]["t1"])
        for uid, row in rows.items():
            queued, ended = row.get("t_queued"), row.get("t_finished")
            if (queued is None or queued <= hi) and (ended is None or ended >= lo):
                recs[uid] = _windowed(uid, row)
    prompt_tokens = output_tokens = retracted = recomputed = 0
    for step in steps:
        prompt, output = step_tokens(step)
        prompt_tokens += prompt
        output_tokens += output
        n, m = step_recompute(step)
        retracted, recomputed = retracted + n, recomputed + m
        for item in step.get("items") or ():
            if not samples(item):
                continue
            uid = int(item["uid"])
            rec = recs.get(uid)
            if rec is None:
                rec = recs[uid] = _windowed(uid, rows.get(uid))
            rec.token_times.append(float(step["t1"]))
            rec.token_steps.append(int(step["step"]))
    for rec in recs.values():
        rec.output_len = len(rec.token_times)  # metrics from the window's tokens, not reported
        first = rec.t_first_token
        if first is None or not rec.token_times or first < rec.token_times[0]:
            rec.t_first_token = None  # its first token is not in the window
    span = float(steps[-1]["t1"]) - float(steps[0]["t0"]) if steps else None
    numbers = (int(steps[0]["step"]), int(steps[-1]["step"])) if steps else (None, None)
    return _summary(
        list(recs.values()),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        span=span,
        steps=(len(steps), *numbers),
        pressure=(retracted, recomputed),
    )


def _windowed(uid: int, row: Message | None) -> RequestRecord:
    """A request's record for a window: its state and times, no tokens yet."""
    rec = RequestRecord(uid)
    if row is not None:
        rec.state = row.get("state", "waiting")
        rec.t_queued, rec.t_admitted = row.get("t_queued"), row.get("t_admitted")
        rec.t_first_token = row.get("t_first_token")
        rec.prompt_len, rec.cached_len = row.get("prompt_len"), row.get("cached_len")
    return rec


def _summary(
    recs: Sequence[RequestRecord],
    *,
    prompt_tokens: int,
    output_tokens: int,
    span: float | None,
    steps: tuple[int, int | None, int | None],
    pressure: tuple[int, int] = (0, 0),
) -> Summary:
    """The one computation of the headline, whatever the records came from."""
    ttfts: list[float] = []
    itls: list[float] = []
    worst: tuple[float, int] | None = None
    looked_up = hits = 0
    for rec in recs:
        if rec.cached_len is not None and rec.prompt_len:
            looked_up += rec.prompt_len
            hits += rec.cached_len
        if rec.t_first_token is not None and rec.t_queued is not None:
            ttfts.append(rec.t_first_token - rec.t_queued)
        itls.extend(gaps(rec.token_times))
        stall = rec.max_stall
        if stall is not None and (worst is None or stall > worst[0]):
            worst = (stall, rec.uid)
    return Summary(
        requests=len(recs),
        finished=sum(r.state == "finished" for r in recs),
        aborted=sum(r.state == "aborted" for r in recs),
        rejected=sum(r.state == "rejected" for r in recs),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        duration_s=span,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        itl_p999_s=percentile(itls, 99.9),
        worst_stall_s=worst[0] if worst else None,
        worst_stall_uid=worst[1] if worst else None,
        output_tok_s=output_tokens / span if span else None,
        steps=steps[0],
        first_step=steps[1],
        last_step=steps[2],
        prefix_hit_rate=hits / looked_up if looked_up else None,
        retractions=pressure[0],
        recomputed_tokens=pressure[1],
    )
