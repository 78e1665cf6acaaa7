"""What one step is, as every tensor-parallel rank sees it: the `StepPlan` rank 0 broadcasts, each
rank's timing of it, and `Ranks`, the runner's view of the other ranks.

Both the runner (engine.runner), which builds and runs plans, and the ranks' transport
(engine.distributed), which sends them, depend on this module, and neither on the other's
internals: the runner sees the other ranks only through the `Ranks` protocol.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from engine.kvcache.table_sync import Span
from instrumentation.records import RankTiming

if TYPE_CHECKING:
    from engine.models.llama import CausalLM


class Ranks(Protocol):
    """Rank 0's handle on the other ranks, as the runner uses it (engine.distributed.Leader)."""

    def guard(self) -> AbstractContextManager[None]: ...

    def publish(self, plan: StepPlan | None) -> None: ...

    def share_tokens(self, tokens: torch.Tensor) -> None: ...

    def worker_times(self, seq: int) -> list[RankTiming]: ...


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step as every rank runs it: request i computes tokens [starts[i], ends[i]) in page
    table row rows[i]. Plain ints only, since rank 0 broadcasts it to the other ranks."""

    seq: int  # launch number, which the ranks' timings are filed under
    rows: list[int]
    starts: list[int]
    ends: list[int]
    ids: list[int]  # token ids of every request's [start, end), flat; 0 where patched
    patch_dst: list[int]  # positions in `ids` whose token the previous step is sampling ...
    patch_src: list[int]  # ... and that token's row in the previous step's sampled tokens
    sample: list[int]  # indices of the requests that sample (all but prompt chunks)
    decode: bool  # a pure decode step: a CUDA graph may run it
    # requests that want prompt logprobs: their logits at positions [prompt_from[j],
    # prompt_upto[j]) are kept (every prompt position not scored yet but the last, whose
    # logits sample)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_from: list[int] = field(default_factory=list)
    prompt_upto: list[int] = field(default_factory=list)
    # page-table entries the other ranks have not seen (engine.kvcache.table_sync)
    spans: list[Span] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class RankClock:
    """Times one rank's part of each step: wall time on CPU, where work runs as it is called
    (and the collectives' share, `comm_s`); CUDA events on a GPU, read once the step ran."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.tp, self.cuda = model.tp, device.type == "cuda"
        self._t0 = 0.0
        self._start: torch.cuda.Event | None = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self.tp.comm_s = 0.0
            self._t0 = time.perf_counter()

    def stop(self) -> RankTimes:
        if not self.cuda:
            return RankTimes(time.perf_counter() - self._t0, self.tp.comm_s)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return RankTimes(None, None, self._start, end)


@dataclass(frozen=True, slots=True)
class RankTimes:
    """One rank's step: seconds, or the CUDA events that will give them."""

    forward_s: float | None
    comm_s: float | None
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None

    def seconds(self) -> tuple[float | None, float | None]:
        """(forward_s, comm_s); waits for the end event on CUDA."""
        if self.start is None or self.end is None:
            return self.forward_s, self.comm_s
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000, None


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Rank 0's times of a step, and where the other ranks' are filed (engine.distributed)."""

    seq: int
    own: RankTimes
    leader: Ranks

    def read(self) -> tuple[RankTiming, ...]:
        forward_s, comm_s = self.own.seconds()
        return (RankTiming(0, forward_s, comm_s), *self.leader.worker_times(self.seq))
