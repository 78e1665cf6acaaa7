"""Scheduler: the waiting queue and the running set; builds each step's batch through a policy
and applies the step's results (chunks continue first, finished requests give their pages back).

A step is applied in two parts, so the next step can be scheduled before this one's tokens are
known (overlap): `advance` right after launch (what was computed is cached; finished prompts
join decode; a request whose last token is being sampled stops being scheduled), and `retire`
when a finished request's final token has been read (it gives its row and pages back).

The queue sizes and the reserved tokens are counters, updated as requests move, so reading them
costs O(1) however long the queue: they are read every step (the step record) and, from other
threads, on every submit (`LLM.num_waiting`). Each is one int, so a reader on another thread sees
a value that held at some moment. `recount()` recomputes them by scanning, for checks.
"""

from __future__ import annotations

from collections import deque
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


@dataclass(frozen=True, slots=True)
class QueueCounts:
    num_waiting: int
    num_running: int
    reserved_tokens: int


def _chunk_reserve(pending: PendingReq) -> int:
    """Tokens still promised to a request part-way through its chunks: the rest of its prompt
    and all of its output."""
    assert pending.chunked_req is not None
    st = pending.state
    return st.prompt_len - pending.chunked_req.cached_len + st.params.max_tokens


def _decode_reserve(req: Req) -> int:
    """Tokens still promised to a decoding request: the outputs not yet launched."""
    st = req.state
    return st.params.max_tokens - st.launched_tokens


class Scheduler:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.waiting: deque[PendingReq] = deque()  # FIFO; a chunked request is at the head
        self.running: list[Req] = []
        self.finishing: list[Req] = []  # sampling their last token; retired when it is read
        self._num_waiting = 0  # in `waiting` and not yet admitted
        self._num_running = 0  # admitted and not yet ended (chunking ones included)
        self._reserved = 0  # see reserved_tokens() and _account()
        self._remaining: dict[int, int] = {}  # uid -> its part of `_reserved`

    # -- queue ---------------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        self.waiting.append(PendingReq(state))
        self._num_waiting += 1

    @property
    def num_running(self) -> int:
        """Admitted, unfinished requests; one part-way through its chunks counts."""
        return self._num_running

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reserved_tokens(self) -> int:
        """Promised but not yet computed: remaining prompt plus remaining max_tokens."""
        return self._reserved

    def recount(self) -> QueueCounts:
        """The counters recomputed by scanning every queue (O(requests); for checks)."""
        chunking = [p for p in self.waiting if p.chunked_req is not None]
        reserved = sum(map(_decode_reserve, self.running)) + sum(map(_chunk_reserve, chunking))
        return QueueCounts(
            len(self.waiting) - len(chunking),
            len(self.running) + len(self.finishing) + len(chunking),
            reserved,
        )

    def check_counters(self) -> None:
        counted = QueueCounts(self._num_waiting, self._num_running, self._reserved)
        assert counted == self.recount(), f"queue counters drifted: {counted} != {self.recount()}"
        assert self._reserved == sum(self._remaining.values()), "reserved tokens drifted"
        assert len(self._remaining) == self._num_running, "a promise outlived its request"
        kinds = [p.chunked_req is not None for p in self.waiting]
        assert kinds == sorted(kinds, reverse=True), "a chunked request is not at the queue's head"

    # -- one step ------------------------------------------------------------------------
    def schedule(self, policy: SchedulePolicy, budget: int, now: float) -> Scheduled | None:
        adder = PrefillAdder(budget, self.kv, now)
        prompt, decodes = policy.select(adder, self.waiting, self.running)
        if not prompt and not decodes:
            return None
        # the prompt work came from the head of the queue, in order
        for _ in prompt:
            if self.waiting.popleft().chunked_req is None:  # admitted now
                self._num_waiting -= 1
                self._num_running += 1
        # an unfinished chunked request goes back to the head of the queue
        for r in reversed(prompt):
            if isinstance(r, ChunkedReq):
                self.waiting.appendleft(PendingReq(r.state, r))
        for req in decodes:
            req.device_len = req.cached_len + 1
        reqs = decodes + prompt
        self._account(adder.admitted, reqs, len(decodes))
        self.kv.map_upto([(r.table_idx, r.device_len) for r in reqs])
        return Scheduled(Batch(reqs, frozenset(r.uid for r in decodes)), adder.admitted)

    def _account(self, admitted: list[Req], reqs: list[Req], num_decodes: int) -> None:
        """Reserved tokens: an admitted request is promised the rest of its prompt and all its
        outputs; a scheduled step's work counts as done, so the figure taken right after
        scheduling is what the step leaves (and equals `recount()` once it is advanced)."""
        for req in admitted:
            st = req.state
            promise = st.prompt_len - req.cached_len + st.params.max_tokens
            self._remaining[st.uid] = promise
            self._reserved += promise
        for i, req in enumerate(reqs):
            # a decode samples one token; prompt work computes its tokens, and samples one
            # when it reaches the end of the prompt
            done = 1 if i < num_decodes else req.extend_len + (1 if req.can_decode else 0)
            self._remaining[req.uid] -= done
            self._reserved -= done

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
        self._end(req)

    def _end(self, req: Req) -> None:
        """An admitted request leaves: its promise is withdrawn, its row and pages go back."""
        self._num_running -= 1
        self._reserved -= self._remaining.pop(req.uid)
        self.release(req)

    def release(self, req: Req) -> None:
        # KV exists for every token but the last sampled one, which was never fed back
        computed = req.all_ids[: req.cached_len]
        self.kv.release(req.table_idx, req.cache_handle, computed)

    def abort(self, uid: int) -> RequestState | None:
        for i, p in enumerate(self.waiting):
            if p.uid == uid:
                del self.waiting[i]
                if p.chunked_req is None:
                    self._num_waiting -= 1
                else:  # admitted: it holds a row, pages and a lock
                    self._end(p.chunked_req)
                return p.state
        for group in (self.running, self.finishing):
            for i, req in enumerate(group):
                if req.uid == uid:
                    del group[i]
                    self._end(req)
                    return req.state
        return None

    def active_rows(self) -> list[int]:
        rows = [r.table_idx for r in self.running + self.finishing]
        # chunked requests are always the head of the queue (see check_counters)
        for p in self.waiting:
            if p.chunked_req is None:
                break
            rows.append(p.chunked_req.table_idx)
        return rows
