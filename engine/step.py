"""The step pipeline (engine thread only): apply the commands queued since the last step,
schedule a batch under the live budget and policy, launch it, read its tokens and turn them into
the step record and the token and request events, in the order the protocol promises.

With overlap, step N+1 is scheduled and launched while step N runs on the device; a request that
samples its last token in a launched step gives its row and pages back at once, so the next step
is scheduled from the same pool whether or not steps overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.build import EngineParts
from engine.config import LiveConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.request import Req, RequestState
from engine.runner import Launched
from engine.scheduler.batch import Batch
from engine.scheduler.policy import POLICIES, SchedulePolicy
from instrumentation.protocol import WaitReason
from instrumentation.records import (
    EngineEvent,
    KVStats,
    QueueStats,
    RequestEvent,
    StepItem,
    StepRecord,
    TokenEvent,
)
from instrumentation.sampling import SamplingParams

log = logging.getLogger("engine.llm")

Hook = Callable[[Any], None]
# a command from any thread, applied at the next step: ("submit", (uid, ids, params, source))
# or ("abort", uid)
Command = tuple[str, Any]


def _item(batch: Batch, req: Req) -> StepItem:
    kind = batch.kind(req)
    sample = kind == "recompute" and batch.samples(req)  # the piece that ends a recompute
    return StepItem(req.uid, kind, req.cached_len, req.device_len, sample=sample)


def _retracted_event(st: RequestState, t: float) -> RequestEvent:
    """`output_len`: its tokens so far, one still in flight included (its `token` message comes
    first); `recompute_len`: the tokens it needs computed again, prompt plus those outputs."""
    n = st.launched_tokens
    return RequestEvent(
        st.uid, "retracted", t, {"output_len": n, "recompute_len": st.prompt_len + n}
    )


def _admitted_event(st: RequestState, t: float) -> RequestEvent:
    """`cached_len`: the prefix-cache hit of this admission; a retracted request admitted again
    says so (`recompute`), and its first admission's figures stand."""
    if st.retractions:
        fields = {"cached_len": st.matched_len, "recompute": True}
        return RequestEvent(st.uid, "admitted", t, fields)
    return RequestEvent(st.uid, "admitted", t, {"cached_len": st.cached_len})


@dataclass
class Hooks:
    """The observers of the engine: each event, each step record, and the wait for the device."""

    event: list[Hook] = field(default_factory=list)
    step: list[Hook] = field(default_factory=list)
    wait: list[Callable[[], None]] = field(default_factory=list)

    def emit(self, events: list[EngineEvent]) -> None:
        for ev in events:
            self._call(self.event, ev)
            if isinstance(ev, StepRecord):
                self._call(self.step, ev)

    def waiting(self) -> None:
        for fn in self.wait:
            try:
                fn()
            except Exception:  # as for event hooks: never the engine's failure
                log.exception("wait hook %r failed", fn)

    @staticmethod
    def _call(hooks: list[Hook], ev: EngineEvent) -> None:
        for fn in hooks:
            try:
                fn(ev)
            except Exception:  # an observer must never take the engine down
                log.exception("hook %r failed", fn)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A launched step whose tokens have not been applied yet. `kv` and `queue` are taken when
    it was scheduled, so its record is the same whether or not steps overlap."""

    batch: Batch
    items: tuple[StepItem, ...]
    admitted: list[Req]
    retracted: list[RequestState]
    out: Launched
    live: LiveConfig
    t0: float
    kv: KVStats
    queue: QueueStats
    ratio: float  # new_token_ratio as the step was scheduled


class StepPipeline:
    """Runs on the engine thread only. `take_commands` hands over the commands queued by other
    threads; `on_end` is told of every request that ends (finished or aborted)."""

    def __init__(
        self,
        parts: EngineParts,
        live: LiveConfig,
        clock: Callable[[], float],
        hooks: Hooks,
        take_commands: Callable[[], list[Command]],
        on_end: Callable[[int, RequestState], None],
    ) -> None:
        self.scheduler, self.kv, self.runner = parts.scheduler, parts.kv, parts.runner
        self.leader, self.device, self.tokenizer = parts.leader, parts.device, parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.overlap = bool(parts.config.overlap)
        self.live = live  # replaced whole by `LLM.set_config`; each step reads one snapshot
        self.now, self.hooks = clock, hooks
        self._take_commands, self._on_end = take_commands, on_end
        self._policies: dict[str, SchedulePolicy] = {n: p() for n, p in POLICIES.items()}
        self.step_no = 0
        self.inflight: InFlight | None = None  # with overlap: launched, tokens not yet read
        # sampling their last token: pages and row already given back, final token not read yet
        self.finishing: dict[int, Req] = {}

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    def kv_stats(self) -> KVStats:
        return self.kv.stats(self.scheduler.reserved_tokens())

    def pool(self) -> dict[str, int]:
        """The pool now, as a step's `kv` says it (for the events that end a request)."""
        kv = self.kv_stats()
        return {"total": kv.total, "used": kv.used, "cached": kv.cached, "free": kv.free,
                "reserved": kv.reserved}  # fmt: skip

    def queue_stats(self, waiting_reason: WaitReason | None = None) -> QueueStats:
        sched = self.scheduler
        return QueueStats(sched.num_waiting, sched.num_running, waiting_reason)

    def _drain(self) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        t = self.now()
        for kind, arg in self._take_commands():
            if kind == "submit":
                events.append(self._admit(t, *arg))
                continue
            uid = arg
            state = self.scheduler.abort(uid)
            if state is None and (req := self.finishing.pop(uid, None)) is not None:
                state = req.state  # its pages are back already; its last token is dropped
            if state is not None:
                state.aborted = True  # a step in flight must not give it a token
                # its figures as far as it got: an API ending it on a stop string counts it
                fields = {"output_len": len(state.output_ids), **self._metrics(state)}
                events.append(RequestEvent(uid, "aborted", t, fields))
                self._on_end(uid, state)
                fields["kv"] = self.pool()  # its pages are back: an idle engine says so here
        return events

    def _admit(
        self, t: float, uid: int, ids: list[int], params: SamplingParams, source: str | None
    ) -> RequestEvent:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        state = RequestState(uid, ids, params, t, detok, generator=gen)
        self.scheduler.add(state)
        fields: dict[str, Any] = {"prompt_len": len(ids), "max_tokens": params.max_tokens}
        if source is not None:
            fields["source"] = source
        return RequestEvent(uid, "queued", t, fields)

    def step(self) -> StepRecord | None:
        """Run one engine step; see `LLM.step`."""
        if self.leader is not None:
            self.leader.check()  # a dead rank ends the engine, even an idle one
        pre = self._drain()
        if not self.overlap:
            self.hooks.emit(pre)
        live = self.live
        t0 = self.now()
        scheduled = self.scheduler.schedule(
            self._policies[live.policy], live.max_extend_tokens, t0, live.admission
        )
        prev, launched = self.inflight, None
        if scheduled is not None:
            batch = scheduled.batch
            items = tuple(_item(batch, r) for r in batch.reqs)
            # the pool and queue as this step left them: its batch admitted and allocated
            kv, queue = self.kv_stats(), self.queue_stats(scheduled.waiting_reason)
            out = self.runner.launch(batch, prev.out if prev is not None else None)
            launched = InFlight(
                batch, items, scheduled.admitted, scheduled.retracted, out, live, t0, kv, queue,
                self.scheduler.ratio.value,
            )  # fmt: skip
        if not self.overlap:
            if launched is None:
                return None
            self._advance(launched.batch)
            return self._complete(launched)
        self.inflight = launched
        record = self._complete(prev) if prev is not None else None
        # after the previous step's tokens are applied: every token this step was fed is known
        # on the host, so a request sampling its last token can give its pages back now
        if launched is not None:
            self._advance(launched.batch)
        # this call's queued / aborted events follow the record of the step that was already
        # running when they were applied
        self.hooks.emit(pre)
        return record

    def _advance(self, batch: Batch) -> None:
        """A launched step's work counts as computed. A request that samples its last token in
        it is retired at once (row and pages back, prompt cached), in both modes alike, so the
        next step is scheduled from the same pool whether or not steps overlap."""
        ended = [r for r in batch.reqs if r.state.aborted or r.state.finish_reason is not None]
        if ended:  # an EOS read late, or an abort, while it ran: nothing of it goes on
            gone = {r.uid for r in ended}
            batch = Batch([r for r in batch.reqs if r.uid not in gone], batch.decode - gone)
        self.scheduler.advance(batch)
        for req in list(self.scheduler.finishing):
            self.scheduler.retire(req)
            self.finishing[req.uid] = req

    def _complete(self, step: InFlight) -> StepRecord:
        """Read a launched step's tokens and apply them: outputs, finishes, the step record and
        its events."""
        if self.hooks.wait and not step.out.done():
            self.hooks.waiting()
        tokens = step.out.result()
        logprobs = step.out.logprob_rows()
        for req, rows in step.out.prompt_rows():
            req.state.prompt_logprobs += [[lp, top] for lp, top in rows]
        t1 = self.now()
        post: list[EngineEvent] = []
        # retracted when this step was scheduled: back in the queue, outputs kept, to be
        # recomputed (a token in flight for it was applied with the step before)
        req_events = [_retracted_event(st, step.t0) for st in step.retracted]
        req_events += [_admitted_event(r.state, step.t0) for r in step.admitted]
        finished = []
        gone: set[int] = set()
        for i, (req, tok) in enumerate(zip(step.out.reqs, tokens, strict=True)):
            st = req.state
            if st.aborted or st.finish_reason is not None:
                # it ended while this step ran (aborted, or an EOS read one step late): the
                # token is dropped, and its item is marked wasted
                gone.add(req.uid)
                continue
            req.append_token(tok, t1, self.step_no)  # the number its record will carry
            token = TokenEvent(req.uid, t1, tok, st.detok.push(tok))
            if logprobs is not None and st.params.logprobs is not None:
                lp, top = logprobs[i]
                token = replace(token, logprob=lp, top_logprobs=top[: st.params.logprobs])
                st.output_logprobs.append([lp, token.top_logprobs])
            post.append(token)
            if len(st.output_ids) == 1:
                first = {} if st.params.prompt_logprobs is None else prompt_logprobs(st)
                req_events.append(RequestEvent(req.uid, "first_token", t1, first))
            if tok in self.eos_token_ids and not st.params.ignore_eos:
                st.finish_reason = "eos"
            elif len(st.output_ids) >= st.params.max_tokens:
                st.finish_reason = "length"
            if st.finish_reason is not None:
                st.t_finished = t1
                finished.append(req)
        for req in finished:
            st = req.state
            if self.finishing.pop(req.uid, None) is None:  # an EOS before its last token
                self.scheduler.retire(req)
            req_events.append(
                RequestEvent(
                    st.uid,
                    "finished",
                    t1,
                    {
                        "output_len": len(st.output_ids),
                        "finish_reason": st.finish_reason,
                        "text": st.detok.text(),
                        **self._metrics(st),
                    },
                )
            )
            self._on_end(st.uid, st)
        if finished:  # the pool with their pages back: no step follows if the engine goes idle
            pool = self.pool()
            for ev in req_events[-len(finished) :]:
                ev.fields["kv"] = pool

        items = step.items
        gone |= {r.uid for r in step.batch.reqs if r.state.aborted}  # chunks don't sample
        if gone:  # the device did this work; the record says it was thrown away
            items = tuple(replace(it, wasted=True) if it.uid in gone else it for it in items)
        record = StepRecord(
            step=self.step_no,
            t0=step.t0,
            t1=t1,
            phase=step.batch.phase,
            budget=step.live.max_extend_tokens,
            policy=step.live.policy,
            items=items,
            kv=step.kv,
            queue=step.queue,
            ranks=step.out.rank_times(),
            admission=step.live.admission,
            new_token_ratio=step.ratio,
            retracted=tuple(st.uid for st in step.retracted),
        )
        self.step_no += 1
        self.hooks.emit([record, *post, *req_events])
        return record

    def _metrics(self, st: RequestState) -> dict[str, Any]:
        m = st.metrics()
        m.pop("inter_token_latency_seconds")  # the token events carry those
        return m


def prompt_logprobs(st: RequestState) -> dict[str, Any]:
    """A request's prompt logprobs, each token's top cut to the number it asked for."""
    k = st.params.prompt_logprobs
    return {"prompt_logprobs": [[lp, top[:k]] for lp, top in st.prompt_logprobs]}
