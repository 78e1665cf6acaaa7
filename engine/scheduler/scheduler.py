"""Scheduler: the waiting queue and the running set; builds each step's batch through a policy
and applies the step's results (chunks continue first, finished requests give their pages back).
Under optimistic admission a decode step short of pages retracts running requests first: back
to the head of the queue, outputs kept, recomputed when admitted again.

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

import itertools
from collections import deque
from dataclasses import dataclass

from engine.kvcache.manager import KVManager
from engine.request import ChunkedReq, PendingReq, Req, RequestState
from engine.scheduler.admission import NewTokenRatio
from engine.scheduler.batch import Batch
from engine.scheduler.policy import SchedulePolicy
from engine.scheduler.prefill import PrefillAdder
from instrumentation.protocol import WaitReason


@dataclass(frozen=True, slots=True)
class Scheduled:
    batch: Batch
    admitted: list[Req]
    retracted: list[RequestState]
    waiting_reason: WaitReason | None


@dataclass(frozen=True, slots=True)
class QueueCounts:
    num_waiting: int
    num_running: int
    promised_tokens: int
    estimated_tokens: int


def _promise(st: RequestState, input_left: int) -> tuple[int, int]:
    """(promised, estimated) tokens of an admitted request with `input_left` input tokens still
    to compute: those, and its outputs not yet launched, which reserve admission promises and
    optimistic admission only estimates."""
    outputs = st.outputs_left
    if st.outputs_promised:
        return input_left + outputs, 0
    return input_left, outputs


class Scheduler:
    def __init__(self, kv: KVManager, ratio: NewTokenRatio | None = None) -> None:
        self.kv = kv
        self.waiting: deque[PendingReq] = deque()  # FIFO; a chunked request is at the head
        self.running: list[Req] = []
        self.finishing: list[Req] = []  # sampling their last token; retired when it is read
        self.ratio = ratio or NewTokenRatio()
        self._num_waiting = 0  # in `waiting` and not yet admitted
        self._num_running = 0  # admitted and not yet ended (chunking ones included)
        self._reserved = 0  # promised tokens: see reserved_tokens() and _account()
        self._estimated = 0  # optimistic admissions' outputs not yet launched
        self._remaining: dict[int, list[int]] = {}  # uid -> [promised, estimated] of it
        self._retracted: set[int] = set()  # retracted and waiting to be admitted again
        self._admissions = itertools.count()
        self.num_retractions = 0  # since start

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
        """Tokens admitted requests are promised or estimated to need, not yet computed: the
        rest of their inputs, plus their outputs not yet launched, all of them under reserve
        admission and times `new_token_ratio` under optimistic admission."""
        return self._reserved + self.ratio.tokens(self._estimated)

    def recount(self) -> QueueCounts:
        """The counters recomputed by scanning every queue (O(requests); for checks)."""
        chunking = [p.chunked_req for p in self.waiting if p.chunked_req is not None]
        promised = estimated = 0
        for req in self.running:  # decoding: only outputs are left
            p, e = _promise(req.state, 0)
            promised, estimated = promised + p, estimated + e
        for req in chunking:
            p, e = _promise(req.state, req.state.input_len - req.cached_len)
            promised, estimated = promised + p, estimated + e
        return QueueCounts(
            len(self.waiting) - len(chunking),
            len(self.running) + len(self.finishing) + len(chunking),
            promised,
            estimated,
        )

    def check_counters(self) -> None:
        counted = QueueCounts(self._num_waiting, self._num_running, self._reserved, self._estimated)
        assert counted == self.recount(), f"queue counters drifted: {counted} != {self.recount()}"
        assert self._reserved == sum(r[0] for r in self._remaining.values()), "promises drifted"
        assert self._estimated == sum(r[1] for r in self._remaining.values()), "estimate drifted"
        assert len(self._remaining) == self._num_running, "a promise outlived its request"
        kinds = [p.chunked_req is not None for p in self.waiting]
        assert kinds == sorted(kinds, reverse=True), "a chunked request is not at the queue's head"
        assert self._retracted == {p.uid for p in self.waiting if p.state.retractions} - {
            p.uid for p in self.waiting if p.chunked_req is not None
        }, "retracted requests drifted"

    # -- one step ------------------------------------------------------------------------
    def schedule(
        self, policy: SchedulePolicy, budget: int, now: float, admission: str = "reserve"
    ) -> Scheduled | None:
        optimistic = admission == "optimistic"
        adder = PrefillAdder(
            budget,
            self.kv,
            now,
            optimistic=optimistic,
            hold=lambda outputs: self.ratio.tokens(self._estimated + outputs),
            admit_seq=lambda: next(self._admissions),
        )
        retracted: list[RequestState] = []

        def decode() -> list[Req]:
            retracted.extend(self._make_room(self.running))
            if retracted:
                adder.frozen = True
            decodes = list(self.running)
            for req in decodes:
                req.device_len = req.cached_len + 1
            # their pages first, so that admissions in this step cannot take them
            self.kv.map_upto([(r.table_idx, r.device_len) for r in decodes])
            return decodes

        prompt, decodes = policy.select(adder, self.waiting, decode)
        if retracted:
            survivors = [r.state for r in self.running]
            self.ratio.after_retraction(
                sum(st.launched_tokens for st in survivors),
                sum(st.params.max_tokens for st in survivors),
                len(survivors),
            )
        else:
            self.ratio.decay()
        # the retracted requests now lead the queue, waiting for pages
        reason = "kv" if retracted else adder.waiting_reason
        if not prompt and not decodes:
            # a retraction always leaves work: a request is retracted only for another one's
            # decode, and a lone request always fits (submit refuses what the pool cannot hold)
            assert not retracted, "retracted with nothing left to run"
            return None
        # the prompt work came from the head of the queue, in order
        for _ in prompt:
            pending = self.waiting.popleft()
            if pending.chunked_req is None:  # admitted now
                self._num_waiting -= 1
                self._num_running += 1
                self._retracted.discard(pending.uid)
        # an unfinished chunked request goes back to the head of the queue
        for r in reversed(prompt):
            if isinstance(r, ChunkedReq):
                self.waiting.appendleft(PendingReq(r.state, r))
        reqs = decodes + prompt
        self._account(adder.admitted, reqs, len(decodes))
        self.kv.map_upto([(r.table_idx, r.device_len) for r in prompt])
        if not self._num_waiting:
            reason = None
        return Scheduled(
            Batch(reqs, frozenset(r.uid for r in decodes)), adder.admitted, retracted, reason
        )

    def _make_room(self, running: list[Req]) -> list[RequestState]:
        """Retract running requests until every one left can have a page for its next token:
        those whose outputs were only estimated (optimistic admission), the most recently
        admitted first (SGLang's order). A request admitted under `reserve` has its pages
        promised and is never retracted, so one short of pages is always optimistic itself."""
        kv = self.kv
        extra = {r.uid: kv.extra_pages(r.table_idx, r.cached_len + 1) for r in running}
        need = sum(extra.values())
        if need <= kv.available():
            return []
        victims = sorted(
            (r for r in running if not r.state.outputs_promised),
            key=lambda r: r.state.admit_seq,
        )
        out: list[RequestState] = []
        while need > kv.available():
            victim = victims.pop()  # a shortfall implies an optimistic request is running
            need -= extra[victim.uid]
            self._retract(victim)
            out.append(victim.state)
        # the earliest admitted is readmitted first: behind any request part-way through its
        # chunks (they hold their pages), ahead of everything that never ran
        at = sum(1 for p in self.waiting if p.chunked_req is not None)
        for st in out:
            self.waiting.insert(at, PendingReq(st))
        return out

    def _retract(self, req: Req) -> None:
        """Back to the waiting queue with its generated tokens kept: its promise is withdrawn,
        its computed KV given to the prefix cache (what it can share survives for the
        recompute, until evicted) and its row and pages back."""
        self.running.remove(req)
        self._end(req)
        st = req.state
        st.retractions += 1
        self._num_waiting += 1
        self._retracted.add(st.uid)
        self.num_retractions += 1

    def _account(self, admitted: list[Req], reqs: list[Req], num_decodes: int) -> None:
        """Reserved tokens: an admitted request is promised the rest of its input (and, under
        reserve admission, all its outputs; under optimistic they are estimated); a scheduled
        step's work counts as done, so the figure taken right after scheduling is what the
        step leaves (and equals `recount()` once it is advanced)."""
        for req in admitted:
            promised, estimated = _promise(req.state, req.state.input_len - req.cached_len)
            self._remaining[req.uid] = [promised, estimated]
            self._reserved += promised
            self._estimated += estimated
        for i, req in enumerate(reqs):
            # a decode samples one token; prompt work computes its tokens, and samples one
            # when it reaches the end of its input
            decode = i < num_decodes
            computed = 0 if decode else req.extend_len
            sampled = 1 if decode or req.can_decode else 0
            rem = self._remaining[req.uid]
            if req.state.outputs_promised:
                rem[0] -= computed + sampled
                self._reserved -= computed + sampled
            else:
                rem[0] -= computed
                rem[1] -= sampled
                self._reserved -= computed
                self._estimated -= sampled

    def advance(self, batch: Batch) -> None:
        """Right after launch: the step's KV counts as computed, and the whole pages of its
        prompt work join the prefix cache; finished prompts decode from the next step; a
        request sampling its `max_tokens`-th token is not scheduled again."""
        decoding = [r for r in self.running if r.uid not in batch.decode]
        for req in batch.reqs:
            req.cached_len = req.device_len
            if req.uid not in batch.decode:
                # Sharing before the KV is on the device is safe: this step is launched and the
                # next is not yet scheduled, so a request that matches these pages is admitted
                # in a later step, which runs after this one (one stream, and every rank runs
                # the steps in order): it reads them after this step wrote them.
                st = req.state
                ids = st.prompt_ids + st.output_ids if st.output_ids else st.prompt_ids
                self.kv.cache_running(req.table_idx, req.cache_handle, ids, req.cached_len)
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
        and give its row and pages back. One retracted while that token was in flight (an EOS
        read late) only leaves the queue: it holds nothing."""
        if req.uid in self._retracted:
            self._drop_waiting(req.uid)
            return
        if req in self.finishing:
            self.finishing.remove(req)
        else:
            self.running.remove(req)
        self._end(req)

    def _drop_waiting(self, uid: int) -> None:
        for i, p in enumerate(self.waiting):
            if p.uid == uid:
                del self.waiting[i]
                self._num_waiting -= 1
                self._retracted.discard(uid)
                return
        raise AssertionError(f"request {uid} is not waiting")

    def _end(self, req: Req) -> None:
        """An admitted request leaves: its promise is withdrawn, its row and pages go back."""
        self._num_running -= 1
        promised, estimated = self._remaining.pop(req.uid)
        self._reserved -= promised
        self._estimated -= estimated
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
                    self._retracted.discard(uid)
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
