"""One request as the fold keeps it (`RequestRecord`, what `hello.history.requests` shows) and a
gap in the broadcast sequence (`Gap`): the records instrumentation.fold builds, and reads back
from a hello or a recording (`record_from_dict`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from instrumentation.delay import Delay
from instrumentation.metrics import request_metrics
from instrumentation.protocol import ENDED_STATES, RequestState
from instrumentation.waits import GapDelay

# a rough size of what one ended request keeps, for the byte bound of the ended-request memory
_RECORD_BYTES = 600
_TOKEN_BYTES = 64  # a float and an int in lists, and its share of the text
_GAP_BYTES = 400  # a token's wait by cause (delay_gaps): a record and one or two charges


@dataclass(slots=True)
class RequestRecord:
    """One request as `hello.history.requests` shows it (docs/protocol.md plus documented
    extras)."""

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
    source: str | None = None
    retractions: int = 0  # times retracted (v1.3): back to waiting, outputs kept, recomputed
    kv_after: dict[str, int] | None = None  # the pool once it ended (its event's `kv`)
    token_times: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # the step number of each token
    pieces: list[str] = field(default_factory=list)
    final_text: str | None = None
    # metrics as a hello reported them, for a record loaded without its token times
    reported_metrics: dict[str, Any] | None = None
    # computed once when the request ended: its figures never change, so `hello` never
    # recomputes them
    cached_metrics: dict[str, Any] | None = None
    delay: Delay | None = None  # once it ended (instrumentation.delay); with the fold's ledger,
    # also its wait before each token
    delay_gaps: list[GapDelay] | None = None

    @property
    def text(self) -> str:
        return self.final_text if self.final_text is not None else "".join(self.pieces)

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    def metrics(self) -> dict[str, Any] | None:
        """instrumentation.metrics' figures; as reported (`hello`) where its token times are
        not all known here."""
        if self.cached_metrics is not None:
            return self.cached_metrics
        if len(self.token_times) < self.output_len:  # loaded from a hello: times not known
            return self.reported_metrics
        if self.t_queued is None or not self.token_times:
            return None
        return request_metrics(self.t_queued, self.t_admitted, self.token_times, self.token_steps)

    @property
    def max_stall(self) -> float | None:
        """The longest stall (instrumentation.metrics.max_stall), None if none (or unknown)."""
        m = self.metrics()
        return None if m is None else m.get("max_stall_seconds")

    def approx_bytes(self) -> int:
        size = _RECORD_BYTES + _TOKEN_BYTES * len(self.token_times) + len(self.text)
        return size + _GAP_BYTES * len(self.delay_gaps or ())

    def to_dict(self, metrics: bool = True) -> dict[str, Any]:
        """`metrics=False` leaves out the metrics and the text (cheap: no pass over the token
        times), for a caller that redraws often and needs only the scalar fields."""
        d = {
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
            "source": self.source,
            "retractions": self.retractions,
            "kv_after": self.kv_after,
        }
        if metrics:
            d["text"] = self.text
            d["metrics"] = self.metrics()
            d["delay"] = None if self.delay is None else self.delay.to_dict()
        return d


@dataclass(frozen=True, slots=True)
class Gap:
    """Broadcasts `expected .. got - 1` never arrived."""

    expected: int
    got: int

    @property
    def lost(self) -> int:
        return self.got - self.expected


def record_from_dict(row: dict[str, Any]) -> RequestRecord:
    rec = RequestRecord(uid=row["uid"], state=row.get("state", "waiting"))
    for name in (
        "prompt_len", "cached_len", "max_tokens", "t_queued", "t_admitted", "t_first_token",
        "t_last_token", "t_finished", "finish_reason", "message", "source", "kv_after",
    ):  # fmt: skip
        setattr(rec, name, row.get(name))
    rec.retractions = row.get("retractions") or 0
    rec.output_len = row.get("output_len") or 0
    metrics = row.get("metrics")
    rec.reported_metrics = metrics
    if rec.ended:
        rec.cached_metrics = metrics
        rec.final_text = row.get("text")
        if isinstance(row.get("delay"), dict):
            rec.delay = Delay.from_dict(row["delay"])
    else:  # still generating: later token texts append to what was shown so far
        rec.pieces.append(row.get("text") or "")
    return rec
