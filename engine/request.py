"""Requests as the scheduler sees them: waiting (`PendingReq`), admitted (`Req`), and admitted but
only partly prefilled (`ChunkedReq`), with the per-request facts they share (`RequestState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from instrumentation.metrics import request_metrics
from instrumentation.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.detokenizer import IncrementalDetokenizer
    from engine.kvcache.prefix import CacheHandle

FinishReason = Literal["length", "eos"]


@dataclass(eq=False)
class RequestState:
    """Everything about one request that outlives a single step."""

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    t_queued: float
    detok: IncrementalDetokenizer
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # the step number of each token
    t_admitted: float | None = None
    cached_len: int = 0  # tokens served by the prefix cache at admission
    finish_reason: FinishReason | None = None
    t_finished: float | None = None
    launched_tokens: int = 0  # tokens whose sampling was launched (some may be in flight)
    # with params.prompt_logprobs: [logprob, top [id, logprob] pairs] of prompt tokens 1..
    prompt_logprobs: list[list] = field(default_factory=list)
    # with params.logprobs: the same for each output token
    output_logprobs: list[list] = field(default_factory=list)

    @property
    def prompt_logprobs_done(self) -> bool:
        """Every prompt token after the first is scored (a readmission scores none again)."""
        return len(self.prompt_logprobs) >= self.prompt_len - 1

    aborted: bool = False
    # admission facts, renewed when a retracted request is admitted again
    admit_seq: int = -1  # order of the latest admission (retraction takes the latest first)
    outputs_promised: bool = True  # reserve: its outputs' pages promised; optimistic: estimated
    retractions: int = 0  # times it was retracted (its KV freed, recomputed when readmitted)
    matched_len: int = 0  # tokens the prefix cache served at the latest admission

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def input_len(self) -> int:
        """Tokens to compute before the next sample: the prompt, plus for a retracted request
        the outputs it had generated (recomputed when readmitted)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def outputs_left(self) -> int:
        return self.params.max_tokens - self.launched_tokens

    def metrics(self) -> dict[str, Any]:
        """Its figures as instrumentation.metrics defines them for every view (the stall from
        its tokens' step numbers)."""
        return request_metrics(self.t_queued, self.t_admitted, self.token_times, self.token_steps)


@dataclass(eq=False)
class PendingReq:
    """A request in the waiting queue; `chunked_req` remembers how far its chunking has got."""

    state: RequestState
    chunked_req: ChunkedReq | None = None

    @property
    def uid(self) -> int:
        return self.state.uid

    @property
    def input_len(self) -> int:
        return self.state.input_len


@dataclass(eq=False)
class Req:
    """An admitted request in this step's batch: tokens [cached_len, device_len) are computed."""

    state: RequestState
    table_idx: int
    cache_handle: CacheHandle
    cached_len: int
    device_len: int

    @property
    def uid(self) -> int:
        return self.state.uid

    @property
    def tenancy(self) -> tuple[int, int]:
        """Which admission holds the row: a retracted request admitted again may get other
        pages (or another row), so its page-table entries must be sent again."""
        return self.state.uid, self.state.retractions

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def can_decode(self) -> bool:
        return True

    @property
    def all_ids(self) -> list[int]:
        return self.state.prompt_ids + self.state.output_ids

    def append_token(self, token_id: int, t: float, step: int) -> None:
        """A token sampled by step number `step`, whose tokens were read at `t`."""
        self.state.output_ids.append(token_id)
        self.state.token_times.append(t)
        self.state.token_steps.append(step)


class ChunkedReq(Req):
    """A request only partly prefilled: it neither samples this step nor joins decode."""

    @property
    def can_decode(self) -> bool:
        return False

    def append_token(self, token_id: int, t: float, step: int) -> None:
        raise RuntimeError(
            "a ChunkedReq is never sampled: its logits belong to a mid-prompt position"
        )
