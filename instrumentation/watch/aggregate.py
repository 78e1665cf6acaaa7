"""What a watched engine tells about one step: aggregate counts, never per-request items.

Every adapter turns its source into `AggregateStep`s; the emitter numbers them and sends them as
protocol `step` messages. A field the source does not report stays None and is left out of the
message, so the page can tell "zero" from "not known". Names follow the protocol where the
meaning is the same (`queue.waiting`, `queue.running`, `kv.used`, `kv.total`) and docs/watch.md
says, per source, which upstream figure each field holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Phase = Literal["prefill", "decode", "mixed"]
TimeSource = Literal["log", "estimated", "received"]


@dataclass(frozen=True, slots=True)
class AggregateStep:
    source: str  # "sglang-log", "vllm-log", "sglang-fpm", "vllm-fpm"
    phase: Phase
    t0: float
    t1: float
    t_source: TimeSource  # "log": the line's stamp; "estimated": placed in its second; "received"
    prompt_tokens: int | None = None  # prompt tokens computed this step (not cache hits)
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache this step
    prefill_requests: int | None = None  # requests with prompt work in this step
    decode_requests: int | None = None  # requests decoding in this step
    decode_tokens: int | None = (
        None  # tokens generated (more than decode_requests when speculating)
    )
    waiting: int | None = None  # queue.waiting
    running: int | None = None  # queue.running, in the engine's own sense (docs/watch.md)
    kv: dict[str, Any] | None = None  # token or block figures the source reports; see docs
    budget: int | None = None  # the prompt-token budget (chunk size) when known
    sample_of_steps: int | None = None  # this record summarises that many engine steps
    iteration: int | None = None  # the engine's own step counter, when it prints one
    dp_rank: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # source-specific figures

    def fields(self) -> dict[str, Any]:
        """The step message's fields beyond type, seq and step (None values left out)."""
        out: dict[str, Any] = {
            "source": self.source,
            "t0": self.t0,
            "t1": self.t1,
            "t_source": self.t_source,
            "phase": self.phase,
            "items": [],  # no request ids in these sources: nothing is invented
        }
        queue = {
            k: v for k, v in (("waiting", self.waiting), ("running", self.running)) if v is not None
        }
        if queue:
            out["queue"] = queue
        optional = (
            ("prompt_tokens", self.prompt_tokens),
            ("cached_tokens", self.cached_tokens),
            ("prefill_requests", self.prefill_requests),
            ("decode_requests", self.decode_requests),
            ("decode_tokens", self.decode_tokens),
            ("kv", self.kv),
            ("budget", self.budget),
            ("sample_of_steps", self.sample_of_steps),
            ("iteration", self.iteration),
            ("dp_rank", self.dp_rank),
        )
        out.update((k, v) for k, v in optional if v is not None)
        out.update(self.extra)
        return out
