"""LLM: the engine's front door. Offline `generate`, and the live interface a server drives:
thread-safe `submit` / `abort` / `set_config`, one `step()` at a time, and hooks that see every
step, token and request event in the order the protocol promises.

The work is split by job: engine.config holds the settings (`LLM(...)`'s keyword arguments are
`EngineConfig`'s fields), engine.build makes the parts, engine.step runs the step pipeline on the
engine thread; this module is the frontend that validates requests and queues commands.
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch

from engine.build import build_engine
from engine.config import (
    EngineConfig,
    EngineInfo,
    LiveConfig,
    check_admission,
    check_budget,
    check_policy,
)
from engine.kvcache.manager import KVSnapshot
from engine.prompts import check_fits, encode_prompt
from engine.request import RequestState
from engine.step import Command, Hooks, StepPipeline, prompt_logprobs
from instrumentation.errors import InvalidRequest, NotFound
from instrumentation.records import EngineEvent, KVStats, QueueStats, StepRecord
from instrumentation.sampling import SamplingParams

__all__ = ["LLM", "EngineInfo", "Prompt"]

Prompt = str | Sequence[int]


class LLM:
    """`LLM(model, **settings)`: the settings are `EngineConfig`'s fields, with its defaults
    (see `inspect.signature(LLM)` or `python -m engine.server --help`); `progress` shows the
    model download and load. `LLM.from_config(config)` takes a whole `EngineConfig`."""

    def __init__(
        self,
        model: str | os.PathLike[str] = EngineConfig.model,
        *,
        progress: bool = True,
        **settings: Any,
    ) -> None:
        # validate everything cheap before the slow model load
        self._start(EngineConfig.of("LLM()", model=str(model), **settings), progress)

    @classmethod
    def from_config(cls, config: EngineConfig, *, progress: bool = True) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config.engine(), progress)
        return llm

    def _start(self, config: EngineConfig, progress: bool) -> None:
        live = config.live()
        self._t_start = time.monotonic()
        parts = build_engine(config, progress)
        self.config = parts.config  # every default resolved
        self.info: EngineInfo = parts.info
        self.device, self.dtype = parts.device, parts.dtype
        self.page_size: int = parts.info.page_size
        self.num_pages: int = parts.info.num_pages
        self.max_seq_len: int = parts.info.max_seq_len
        self.overlap: bool = parts.info.overlap
        self.model_config, self.tokenizer, self.model = (
            parts.model_config, parts.tokenizer, parts.model,
        )  # fmt: skip
        self.pool, self.table, self.kv = parts.pool, parts.table, parts.kv
        self.scheduler, self.runner, self.leader = parts.scheduler, parts.runner, parts.leader

        self._lock = threading.Lock()
        self._inbox: list[Command] = []
        self._inbox_submits = 0  # the submits in _inbox, so num_waiting() needs no scan
        self._uids = itertools.count()
        self._live_uids: set[int] = set()  # submitted and not yet ended
        self._aborting: set[int] = set()
        self._collect: dict[int, dict[str, Any] | None] = {}  # uids whose outputs generate() wants
        self.hooks = Hooks()
        self.pipeline = StepPipeline(parts, live, self.now, self.hooks, self._take, self._end)

    # -- facts ---------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.pipeline.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:  # e.g. a test's own stop token
        self.pipeline.eos_token_ids = frozenset(ids)

    def now(self) -> float:
        """Seconds on the engine's monotonic clock, 0 at engine start."""
        return time.monotonic() - self._t_start

    def config_dict(self) -> dict[str, Any]:
        live = self.pipeline.live
        return {
            "max_extend_tokens": live.max_extend_tokens,
            "policy": live.policy,
            "admission": live.admission,
        }

    def kv_stats(self) -> KVStats:
        return self.pipeline.kv_stats()

    def queue_stats(self) -> QueueStats:
        return self.pipeline.queue_stats()

    @property
    def num_retractions(self) -> int:
        """Requests retracted since the start (optimistic admission)."""
        return self.scheduler.num_retractions

    def kv_map(self) -> dict[str, Any]:
        """The pool page by page, each page's owner named (engine thread, between steps)."""
        sched = self.scheduler
        owners = {r.table_idx: r.uid for r in sched.running + sched.finishing}
        for p in sched.waiting:  # requests part-way through their chunks lead the queue
            if p.chunked_req is None:
                break
            owners[p.chunked_req.table_idx] = p.uid
        # `t`: when it was read, so a client can order it against the events it received
        return {"t": self.now(), **self.kv.page_map(owners, sched.reserved_tokens()).to_dict()}

    def flush_cache(self) -> int:
        """Drop the prefix cache's unheld pages (engine thread, between steps); how many."""
        return self.kv.flush_cache()

    def num_waiting(self) -> int:
        return self._inbox_submits + self.scheduler.num_waiting  # two counters: O(1)

    @property
    def in_flight(self) -> bool:
        """A step was launched and its tokens are still to be applied (overlap only)."""
        return self.pipeline.inflight is not None

    def has_work(self) -> bool:
        return bool(self._inbox) or self.pipeline.has_work()

    def check_integrity(self) -> None:
        self.scheduler.check_counters()
        self.kv.check_integrity(self.scheduler.active_rows())

    def integrity_snapshot(self) -> KVSnapshot:
        """Engine thread, between steps: the counter checks (O(rows); raise AssertionError) and
        a copy of the page accounting whose full check, `.check()`, may run on another thread."""
        self.scheduler.check_counters()  # O(queue), which --max-waiting bounds
        self.kv.check_counters()
        return self.kv.snapshot(self.scheduler.active_rows())

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any; the engine cannot step after.
        (A process that exits stops them too.)"""
        if self.leader is not None:
            self.leader.close()

    # -- hooks ---------------------------------------------------------------------------
    def add_step_hook(self, fn: Callable[[StepRecord], None]) -> None:
        self.hooks.step.append(fn)

    def add_event_hook(self, fn: Callable[[EngineEvent], None]) -> None:
        """fn sees every event in protocol order: at step start `queued` / `aborted` /
        `rejected`; after the forward the step record, its tokens, then its request events."""
        self.hooks.event.append(fn)

    def remove_event_hook(self, fn: Callable[[EngineEvent], None]) -> None:
        """Stop calling fn (added by `add_event_hook`); ValueError if it was not added."""
        self.hooks.event.remove(fn)

    def add_wait_hook(self, fn: Callable[[], None]) -> None:
        """fn runs on the engine thread when it is about to wait for the device to finish a
        step. Work handed to another thread there (the server's events) runs while the device
        computes, instead of taking the GIL from the engine thread while it schedules."""
        self.hooks.wait.append(fn)

    def remove_wait_hook(self, fn: Callable[[], None]) -> None:
        """Stop calling fn (added by `add_wait_hook`); ValueError if it was not added."""
        self.hooks.wait.remove(fn)

    # -- commands (any thread) -----------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        return encode_prompt(self.tokenizer, prompt, self.model_config.vocab_size, chat)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        check_fits(prompt_len, max_tokens, max_seq_len=self.max_seq_len,
                   page_size=self.page_size, num_pages=self.num_pages)  # fmt: skip

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        source: str | None = None,
    ) -> int:
        """Validate and queue one request; it enters the scheduler at the next step. `source`
        (e.g. "http") is carried into its `queued` event, to say where it came from."""
        ids, params = self._prepare(prompt, params, chat)
        return self._enqueue(ids, params, source=source)

    def _prepare(
        self, prompt: Prompt, params: SamplingParams | None, chat: bool
    ) -> tuple[list[int], SamplingParams]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt, chat)
        self.check_fits(len(ids), params.max_tokens)
        return ids, params

    def _enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        collect: bool = False,
        source: str | None = None,
    ) -> int:
        with self._lock:
            uid = next(self._uids)
            self._live_uids.add(uid)
            if collect:
                self._collect[uid] = None
            self._inbox.append(("submit", (uid, ids, params, source)))
            self._inbox_submits += 1
        return uid

    def abort(self, uid: int) -> None:
        """Stop a request; a step already running finishes, no later step lists it."""
        with self._lock:
            if uid not in self._live_uids or uid in self._aborting:
                raise NotFound(f"no request with uid {uid} is in flight")
            self._aborting.add(uid)
            self._inbox.append(("abort", uid))

    def set_config(
        self,
        max_extend_tokens: int | None = None,
        policy: str | None = None,
        admission: str | None = None,
    ) -> dict[str, Any]:
        """Change the budget, the policy and/or the admission mode from the next step on;
        invalid values change nothing. Requests already admitted keep the promise they were
        admitted with (reserve: all their pages; optimistic: their prompt's)."""
        if max_extend_tokens is not None:
            check_budget(max_extend_tokens)
        if policy is not None:
            check_policy(policy)
        if admission is not None:
            check_admission(admission)
        with self._lock:
            cur = self.pipeline.live
            self.pipeline.live = LiveConfig(
                cur.max_extend_tokens if max_extend_tokens is None else max_extend_tokens,
                cur.policy if policy is None else policy,
                cur.admission if admission is None else admission,
            )
        return self.config_dict()

    # -- the engine loop (one thread) ----------------------------------------------------
    def step(self) -> StepRecord | None:
        """Run one engine step and return the record of the step that completed in this call,
        or None. Without overlap that is the step just scheduled. With overlap the step just
        scheduled is launched and left running, and the one launched by the previous `step()` is
        completed while it runs; the first `step()` of a burst then returns None with work still
        in flight (`has_work()`)."""
        return self.pipeline.step()

    def _take(self) -> list[Command]:
        with self._lock:
            inbox, self._inbox, self._inbox_submits = self._inbox, [], 0
        return inbox

    def _end(self, uid: int, state: RequestState) -> None:
        with self._lock:
            self._live_uids.discard(uid)
            self._aborting.discard(uid)
            if uid in self._collect:
                self._collect[uid] = self._output(state)

    def _output(self, st: RequestState) -> dict[str, Any]:
        return {
            "uid": st.uid,
            "text": st.detok.text(),
            "token_ids": list(st.output_ids),
            "finish_reason": st.finish_reason,
            "prompt_len": st.prompt_len,
            "cached_len": st.cached_len,
            **({} if st.params.logprobs is None else {"logprobs": st.output_logprobs}),
            **({} if st.params.prompt_logprobs is None else prompt_logprobs(st)),
            "metrics": st.metrics(),
        }

    # -- offline -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[dict[str, Any]]:
        """Run prompts to completion; one dict per prompt (text, token_ids, finish_reason, ...).
        Every prompt is validated before any is queued, so a bad one changes nothing."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params)} sampling params")
        prepared = [self._prepare(p, sp, chat) for p, sp in zip(prompts, params, strict=True)]
        uids = [self._enqueue(ids, sp, collect=True) for ids, sp in prepared]
        while any(self._collect[u] is None for u in uids):
            if self.step() is None and not self.has_work():
                raise RuntimeError("the engine went idle with requests unfinished")
        # with overlap, a step launched for a request whose EOS was read late may still run:
        # complete it when nothing else is queued, so the engine is idle on return
        pipe = self.pipeline
        while pipe.inflight is not None and not self._inbox and not self.scheduler.has_work():
            self.step()
        with self._lock:
            return [self._collect.pop(u) for u in uids]  # type: ignore[misc]


def _signature() -> inspect.Signature:
    """`LLM(model, *, <every other setting>, progress)`, generated from `EngineConfig`."""
    hints = typing.get_type_hints(EngineConfig)
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    for f in fields(EngineConfig):
        kind = P.POSITIONAL_OR_KEYWORD if f.name == "model" else P.KEYWORD_ONLY
        params.append(P(f.name, kind, default=f.default, annotation=hints[f.name]))
    params.append(P("progress", P.KEYWORD_ONLY, default=True, annotation=bool))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
