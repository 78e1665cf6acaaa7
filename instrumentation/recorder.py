"""A bounded history of protocol messages: what a late client needs to redraw the past.

The recorder is a pure function of the message stream (PROTOCOL.md dicts), so the server feeds it
what it broadcasts and a dashboard can feed it what it receives. It keeps the last `max_steps`
step messages, every request still in flight, and the last `max_ended` ended requests, and it
computes each request's latency metrics with `engine.metrics.request_metrics`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.metrics import percentile, request_metrics

RequestState = Literal["waiting", "running", "finished", "aborted", "rejected"]
ENDED_STATES: frozenset[str] = frozenset(("finished", "aborted", "rejected"))
_END_EVENT_STATE: dict[str, RequestState] = {
    "finished": "finished",
    "aborted": "aborted",
    "rejected": "rejected",
}


@dataclass(slots=True)
class RequestRecord:
    """One request as `hello.history.requests` shows it (PROTOCOL.md plus documented extras)."""

    uid: int
    state: RequestState = "waiting"
    prompt_len: int | None = None
    cached_len: int | None = None
    output_len: int = 0
    max_tokens: int | None = None
    t_queued: float | None = None
    t_admitted: float | None = None
    t_first_token: float | None = None
    t_last_token: float | None = None
    t_finished: float | None = None
    finish_reason: str | None = None
    message: str | None = None
    token_times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    final_text: str | None = None
    # Metrics as a hello reported them, for a record loaded without its token times.
    reported_metrics: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.final_text if self.final_text is not None else "".join(self.pieces)

    def metrics(self) -> dict[str, Any] | None:
        if len(self.token_times) < self.output_len:  # loaded from a hello: times not known
            return self.reported_metrics
        if self.t_queued is None or self.t_admitted is None or not self.token_times:
            return None
        return request_metrics(self.t_queued, self.t_admitted, self.token_times)

    def to_dict(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "state": self.state,
            "prompt_len": self.prompt_len,
            "cached_len": self.cached_len,
            "output_len": self.output_len,
            "max_tokens": self.max_tokens,
            "t_queued": self.t_queued,
            "t_admitted": self.t_admitted,
            "t_first_token": self.t_first_token,
            "t_last_token": self.t_last_token,
            "t_finished": self.t_finished,
            "finish_reason": self.finish_reason,
            "message": self.message,
            "text": self.text,
            "metrics": self.metrics(),
        }


class Recorder:
    """Feed it every broadcast message in order with `record()`; read `history()` any time."""

    def __init__(
        self, *, max_steps: int = 2000, max_ended: int = 2000, config: dict[str, Any] | None = None
    ) -> None:
        self.steps: deque[dict[str, Any]] = deque(maxlen=max_steps)
        self.config: dict[str, Any] = dict(config or {})
        self.num_steps = 0
        self._live: dict[int, RequestRecord] = {}
        self._ended: OrderedDict[int, RequestRecord] = OrderedDict()
        self._max_ended = max_ended

    def record(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "step":
            self.steps.append(msg)
            self.num_steps += 1
        elif kind == "token":
            self._on_token(msg)
        elif kind == "request":
            self._on_request(msg)
        elif kind == "config":
            self.config = {k: v for k, v in msg.items() if k not in ("type", "id", "t")}
        elif kind == "hello":
            self.load_hello(msg)

    def load_hello(self, hello: dict[str, Any]) -> None:
        """Start from a server's `hello` (a client reusing the recorder after it connects)."""
        self.steps.clear()
        self._live.clear()
        self._ended.clear()
        self.config = dict(hello.get("config", {}))
        history = hello.get("history", {})
        self.steps.extend(history.get("steps", []))
        self.num_steps = len(self.steps)
        for row in history.get("requests", []):
            rec = _record_from_dict(row)
            if rec.state in ENDED_STATES:
                self._remember_ended(rec)
            else:
                self._live[rec.uid] = rec

    def get(self, uid: int) -> RequestRecord | None:
        return self._live.get(uid) or self._ended.get(uid)

    def requests(self) -> list[RequestRecord]:
        """Recently ended requests, then live ones, each group oldest first."""
        return [*self._ended.values(), *self._live.values()]

    def history(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "requests": [rec.to_dict() for rec in self.requests()],
        }

    def summary(self) -> dict[str, Any]:
        """Counts and latency percentiles (interpolated) over the remembered ended requests."""
        done = [r for r in self._ended.values() if r.state == "finished"]
        metrics = [m for m in (r.metrics() for r in done) if m is not None]
        return {
            "live": len(self._live),
            "finished": len(done),
            "aborted": sum(r.state == "aborted" for r in self._ended.values()),
            "rejected": sum(r.state == "rejected" for r in self._ended.values()),
            "ttft_p50": percentile([m["time_to_first_token_seconds"] for m in metrics], 50),
            "ttft_p99": percentile([m["time_to_first_token_seconds"] for m in metrics], 99),
            "max_stall": max((m["max_stall_seconds"] for m in metrics), default=None),
        }

    def _on_token(self, msg: dict[str, Any]) -> None:
        rec = self._live.get(msg["uid"])
        if rec is None:  # its queued event predates what we saw; nothing to attach to
            return
        rec.token_times.append(msg["t"])
        rec.t_last_token = msg["t"]
        rec.pieces.append(msg.get("text", ""))
        rec.output_len += 1

    def _on_request(self, msg: dict[str, Any]) -> None:
        uid, event, t = msg["uid"], msg["event"], msg["t"]
        rec = self._live.get(uid)
        if rec is None:
            if uid in self._ended:  # a late duplicate for an ended request changes nothing
                return
            rec = self._live[uid] = RequestRecord(uid)
        if event == "queued":
            rec.t_queued = t
            rec.prompt_len = msg.get("prompt_len", rec.prompt_len)
            rec.max_tokens = msg.get("max_tokens", rec.max_tokens)
        elif event == "admitted":
            rec.state = "running"
            rec.t_admitted = t
            rec.cached_len = msg.get("cached_len", rec.cached_len)
        elif event == "first_token":
            rec.t_first_token = t
        elif event in _END_EVENT_STATE:
            rec.state = _END_EVENT_STATE[event]
            rec.t_finished = t
            rec.finish_reason = msg.get("finish_reason")
            rec.message = msg.get("message")
            if "output_len" in msg:
                rec.output_len = msg["output_len"]
            if "text" in msg:
                rec.final_text = msg["text"]
            del self._live[uid]
            self._remember_ended(rec)

    def _remember_ended(self, rec: RequestRecord) -> None:
        self._ended[rec.uid] = rec
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)


def _record_from_dict(row: dict[str, Any]) -> RequestRecord:
    rec = RequestRecord(uid=row["uid"], state=row.get("state", "waiting"))
    for name in (
        "prompt_len", "cached_len", "max_tokens", "t_queued", "t_admitted", "t_first_token",
        "t_last_token", "t_finished", "finish_reason", "message",
    ):  # fmt: skip
        setattr(rec, name, row.get(name))
    rec.output_len = row.get("output_len") or 0
    rec.reported_metrics = row.get("metrics")
    if rec.state in ENDED_STATES:
        rec.final_text = row.get("text")
    else:  # still generating: later token texts append to what was shown so far
        rec.pieces.append(row.get("text") or "")
    return rec
