"""Small, plain records the engine hands to its hooks: one per step, token and request event.

Each `to_dict()` is the message of the same name in docs/protocol.md (version 1), so a
publisher can send it as it is. The engine builds them from facts it already has; they hold no
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from instrumentation.protocol import WaitReason

ItemKind = Literal["chunk", "prefill", "decode", "recompute"]
Phase = Literal["prefill", "decode", "mixed"]
RequestEventKind = Literal[
    "queued", "admitted", "first_token", "finished", "aborted", "rejected", "retracted"
]


@dataclass(frozen=True, slots=True)
class StepItem:
    """One request's share of a step: tokens `[start, end)` were computed. `wasted`: the request
    ended (aborted, or an EOS read one step late) while the step ran, so the work was thrown away.
    `sample`: a `recompute` piece that ends the recompute and samples the next token (prefill
    and decode items always sample, chunks never)."""

    uid: int
    kind: ItemKind
    start: int
    end: int
    wasted: bool = False
    sample: bool = False

    @property
    def samples(self) -> bool:
        return self.kind in ("prefill", "decode") or self.sample

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class KVStats:
    """Pool occupancy in pages (`used + cached + free == total`); `reserved` is in tokens."""

    total: int
    used: int
    cached: int
    free: int
    reserved: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    """`waiting_reason`: why the head of the queue was not admitted (None: nothing waits).
    Admission is FIFO, so every waiting request waits behind the head, for the same reason."""

    waiting: int
    running: int
    waiting_reason: WaitReason | None = None

    def by_reason(self) -> dict[str, int]:
        """vLLM's `num_requests_waiting_by_reason`: the waiting requests counted by reason."""
        if self.waiting_reason is None or not self.waiting:
            return {}
        return {self.waiting_reason: self.waiting}


@dataclass(frozen=True, slots=True)
class RankTiming:
    """One tensor-parallel rank's share of a step: seconds from its start of the step to its
    result, and of those the seconds in collectives (None where not measured: on CUDA)."""

    rank: int
    forward_s: float | None
    comm_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    t0: float
    t1: float
    phase: Phase
    budget: int
    policy: str
    items: tuple[StepItem, ...]
    kv: KVStats
    queue: QueueStats
    ranks: tuple[RankTiming, ...] | None = None  # tensor parallelism only
    admission: str = "reserve"
    new_token_ratio: float = 1.0  # optimistic admission's estimate of outputs still to come
    retracted: tuple[int, ...] = ()  # uids retracted when this step was scheduled

    @property
    def prompt_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if i.kind != "decode")

    @property
    def recompute_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if i.kind == "recompute")

    @property
    def live_items(self) -> tuple[StepItem, ...]:
        """The items whose work reached a request still running."""
        return tuple(i for i in self.items if not i.wasted)

    @property
    def num_decodes(self) -> int:
        return sum(1 for i in self.items if i.kind == "decode")

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "step",
            "step": self.step,
            "t0": self.t0,
            "t1": self.t1,
            "phase": self.phase,
            "budget": self.budget,
            "policy": self.policy,
            # hand-written: dataclasses.asdict deep-copies and costs ~40x more per step
            "items": [_item_dict(i) for i in self.items],
            "kv": {
                "total": self.kv.total,
                "used": self.kv.used,
                "cached": self.kv.cached,
                "free": self.kv.free,
                "reserved": self.kv.reserved,
            },
            "queue": {
                "waiting": self.queue.waiting,
                "running": self.queue.running,
                "waiting_reason": self.queue.waiting_reason,
                "waiting_by_reason": self.queue.by_reason(),
            },
            "admission": self.admission,
            "new_token_ratio": round(self.new_token_ratio, 4),
            **({} if self.ranks is None else {"ranks": [_rank_dict(r) for r in self.ranks]}),
            **({"retracted": list(self.retracted)} if self.retracted else {}),
        }


def _rank_dict(r: RankTiming) -> dict[str, Any]:
    return {"rank": r.rank, "forward_s": r.forward_s, "comm_s": r.comm_s}


def _item_dict(i: StepItem) -> dict[str, Any]:
    d: dict[str, Any] = {"uid": i.uid, "kind": i.kind, "start": i.start, "end": i.end}
    if i.wasted:  # only then: most items are not, and every byte is sent to every client
        d["wasted"] = True
    if i.sample:
        d["sample"] = True
    return d


@dataclass(frozen=True, slots=True)
class TokenEvent:
    uid: int
    t: float
    token_id: int
    text: str
    # only for a request that asked for logprobs: the token's, and the top [id, logprob] pairs
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "type": "token",
            "uid": self.uid,
            "t": self.t,
            "token_id": self.token_id,
            "text": self.text,
        }
        if self.logprob is not None:
            out["logprob"] = self.logprob
            out["top_logprobs"] = [list(p) for p in self.top_logprobs or ()]
        return out


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """A request's lifecycle event; `fields` carries the event's extra fields (see
    docs/protocol.md)."""

    uid: int
    event: RequestEventKind
    t: float
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "request", "uid": self.uid, "event": self.event, "t": self.t, **self.fields}


EngineEvent = StepRecord | TokenEvent | RequestEvent
