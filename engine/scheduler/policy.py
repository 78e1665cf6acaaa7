"""Scheduling policies: which requests one step holds, given the budget `max_extend_tokens`.

- `prefill_first` (the chapter's rule): one kind per step. Prefill while anything waiting can be
  admitted; decode otherwise. Decode stalls while a long prompt is chunked.
- `mixed` (stall-free batching, Sarathi-Serve): every running request decodes one token, and what
  is left of the budget goes to prompt chunks. Decodes are never held back by the budget; if they
  use all of it, that step does no prompt work. Running requests end within `max_tokens`, so
  prompt work always resumes and nothing waits forever.

A policy asks for the step's decodes through `decode()`, which makes room for their pages first
(retracting running requests under optimistic admission when the pool is short) and returns the
requests that stay; so under `mixed` the decodes' pages are taken before any new admission.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from engine.request import PendingReq, Req
from engine.scheduler.prefill import PrefillAdder


def add_prompt_work(adder: PrefillAdder, waiting: Sequence[PendingReq]) -> list[Req]:
    """FIFO: the head of the queue (a chunked request, if any) first; stop at the first that
    does not fit, so a large request is not starved by smaller ones behind it."""
    reqs: list[Req] = []
    for pending in waiting:
        req = adder.try_add_one(pending)
        if req is None:
            break
        reqs.append(req)
    return reqs


Decode = Callable[[], list[Req]]


class SchedulePolicy(ABC):
    name: str

    @abstractmethod
    def select(
        self, adder: PrefillAdder, waiting: Sequence[PendingReq], decode: Decode
    ) -> tuple[list[Req], list[Req]]:
        """(prompt work, decodes) for one step; the adder holds the step's budget, `decode()`
        gives the running requests that decode this step, with room made for their pages."""


class PrefillFirst(SchedulePolicy):
    name = "prefill_first"

    def select(
        self, adder: PrefillAdder, waiting: Sequence[PendingReq], decode: Decode
    ) -> tuple[list[Req], list[Req]]:
        prompt = add_prompt_work(adder, waiting)
        return (prompt, []) if prompt else ([], decode())


class Mixed(SchedulePolicy):
    name = "mixed"

    def select(
        self, adder: PrefillAdder, waiting: Sequence[PendingReq], decode: Decode
    ) -> tuple[list[Req], list[Req]]:
        decodes = decode()
        adder.token_budget -= len(decodes)  # decodes use the budget up first
        return add_prompt_work(adder, waiting), decodes


POLICIES: dict[str, type[SchedulePolicy]] = {p.name: p for p in (PrefillFirst, Mixed)}
