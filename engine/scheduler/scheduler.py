"""Scheduler: the waiting queue and the running set; builds each step's batch through a policy
and applies the step's results (chunks continue first, finished requests give their pages back).

A step is applied in two parts, so the next step can be scheduled before this one's tokens are
known (overlap): `advance` right after launch (what was computed is cached; finished prompts
join decode; a request whose last token is being sampled stops being scheduled), and `retire`
when a finished request's final token has been read (it gives its row and pages back).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kvcache.manager import KVManager
from engine.request import ChunkedReq, PendingReq, Req, RequestState
from engine.scheduler.batch import Batch
from engine.scheduler.policy import SchedulePolicy
from engine.scheduler.prefill import PrefillAdder


@dataclass(frozen=True, slots=True)
class Scheduled:
    batch: Batch
    admitted: list[Req]


class Scheduler:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.waiting: list[PendingReq] = []
        self.running: list[Req] = []
        self.finishing: list[Req] = []  # sampling their last token; retired when it is read

    # -- queue ---------------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        self.waiting.append(PendingReq(state))

    @property
    def num_running(self) -> int:
        """Admitted, unfinished requests; one part-way through its chunks counts."""
        chunking = sum(1 for p in self.waiting if p.chunked_req is not None)
        return len(self.running) + len(self.finishing) + chunking

    @property
    def num_waiting(self) -> int:
        return sum(1 for p in self.waiting if p.chunked_req is None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reserved_tokens(self) -> int:
        """Promised but not yet computed: remaining prompt plus remaining max_tokens."""
        total = 0
        for req in self.running:
            st = req.state
            total += st.params.max_tokens - st.launched_tokens
        for p in self.waiting:
            if p.chunked_req is not None:
                st = p.state
                total += st.prompt_len - p.chunked_req.cached_len + st.params.max_tokens
        return total

    # -- one step ------------------------------------------------------------------------
    def schedule(self, policy: SchedulePolicy, budget: int, now: float) -> Scheduled | None:
        adder = PrefillAdder(budget, self.kv, now)
        prompt, decodes = policy.select(adder, self.waiting, self.running)
        if not prompt and not decodes:
            return None
        # an unfinished chunked request goes back to the head of the queue
        chunked = [PendingReq(r.state, r) for r in prompt if isinstance(r, ChunkedReq)]
        self.waiting = chunked + self.waiting[len(prompt) :]
        for req in decodes:
            req.device_len = req.cached_len + 1
        reqs = decodes + prompt
        self.kv.map_upto([(r.table_idx, r.device_len) for r in reqs])
        return Scheduled(Batch(reqs, frozenset(r.uid for r in decodes)), adder.admitted)

    def advance(self, batch: Batch) -> None:
        """Right after launch: the step's KV counts as computed; finished prompts decode from
        the next step; a request sampling its `max_tokens`-th token is not scheduled again."""
        decoding = [r for r in self.running if r.uid not in batch.decode]
        for req in batch.reqs:
            req.cached_len = req.device_len
            if not req.can_decode:
                continue
            st = req.state
            st.launched_tokens += 1
            if st.launched_tokens >= st.params.max_tokens:
                self.finishing.append(req)
            else:
                decoding.append(req)
        self.running = decoding

    def retire(self, req: Req) -> None:
        """A request's final token was read (or it was found to end early): stop scheduling it
        and give its row and pages back."""
        if req in self.finishing:
            self.finishing.remove(req)
        else:
            self.running.remove(req)
        self.release(req)

    def release(self, req: Req) -> None:
        # KV exists for every token but the last sampled one, which was never fed back
        computed = req.all_ids[: req.cached_len]
        self.kv.release(req.table_idx, req.cache_handle, computed)

    def abort(self, uid: int) -> RequestState | None:
        for i, p in enumerate(self.waiting):
            if p.uid == uid:
                del self.waiting[i]
                if p.chunked_req is not None:  # admitted: it holds a row, pages and a lock
                    self.release(p.chunked_req)
                return p.state
        for group in (self.running, self.finishing):
            for i, req in enumerate(group):
                if req.uid == uid:
                    del group[i]
                    self.release(req)
                    return req.state
        return None

    def active_rows(self) -> list[int]:
        rows = [r.table_idx for r in self.running + self.finishing]
        return rows + [p.chunked_req.table_idx for p in self.waiting if p.chunked_req is not None]
