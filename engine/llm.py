"""LLM: the engine's front door. Offline `generate`, and the live interface a server drives:
thread-safe `submit` / `abort` / `set_config`, one `step()` at a time, and hooks that see every
step, token and request event in the order the protocol promises.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.registry import create_backend
from engine.config import EngineConfig, LiveConfig, check_budget, check_policy
from engine.detokenizer import IncrementalDetokenizer
from engine.kvcache.manager import KVManager, KVSnapshot, pages_for
from engine.kvcache.naive import NaiveCache
from engine.kvcache.pool import KVPool
from engine.kvcache.prefix import PrefixCache
from engine.kvcache.radix import RadixCache
from engine.kvcache.table import PageTable
from engine.models.loader import build_model, load_tokenizer, read_config, resolve
from engine.models.parallel import SINGLE
from engine.request import Req, RequestState
from engine.runner import Launched, ModelRunner
from engine.scheduler.batch import Batch
from engine.scheduler.policy import POLICIES, SchedulePolicy
from engine.scheduler.scheduler import Scheduler
from instrumentation.errors import InvalidRequest, NotFound, TooLarge
from instrumentation.metrics import request_metrics
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

if TYPE_CHECKING:
    from engine.distributed import Leader

log = logging.getLogger(__name__)

CPU_KV_BYTES = 1 << 30  # default KV budget on CPU; on CUDA most of the free memory
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Prompt = str | Sequence[int]
Hook = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Facts that do not change while the engine runs (the protocol's `hello.engine`)."""

    model: str
    device: str
    dtype: str
    vocab_size: int
    page_size: int
    num_pages: int
    max_running_req: int
    max_seq_len: int
    cache_type: str
    attention_backend: str
    architecture: str
    overlap: bool
    residual_dtype: str
    batch_invariant: bool
    tp_size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A launched step whose tokens have not been applied yet. `kv` and `queue` are taken when
    it was scheduled, so its record is the same whether or not steps overlap."""

    batch: Batch
    items: tuple[StepItem, ...]
    admitted: list[Req]
    out: Launched
    live: LiveConfig
    t0: float
    kv: KVStats
    queue: QueueStats


class LLM:
    def __init__(
        self,
        model: str = "smollm2",
        device: str = "cpu",
        max_extend_tokens: int = 256,
        page_size: int | None = None,
        cache_type: str = "radix",
        max_running_req: int = 32,
        num_pages: int | None = None,
        max_seq_len: int | None = None,
        dtype: str | None = None,
        policy: str = "prefill_first",
        attention_backend: str = "auto",
        cuda_graph: bool = True,
        overlap: bool | None = None,
        residual_dtype: str | None = None,
        batch_invariant: bool = False,
        load_format: str = "auto",
        seed: int = 0,
        progress: bool = True,
        tp_size: int = 1,
    ) -> None:
        # validate everything cheap before the slow model load
        self._live = LiveConfig(max_extend_tokens, policy)
        cfg = EngineConfig(
            model=str(model),
            device=device,  # type: ignore[arg-type]
            dtype=dtype,
            page_size=page_size,
            cache_type=cache_type,
            max_running_req=max_running_req,
            num_pages=num_pages,
            max_seq_len=max_seq_len,
            attention_backend=attention_backend,
            cuda_graph=cuda_graph,
            overlap=overlap,
            residual_dtype=residual_dtype,
            batch_invariant=batch_invariant,
            load_format=load_format,  # type: ignore[arg-type]
            seed=seed,
            tp_size=tp_size,
        )
        self.config = cfg
        self._t_start = time.monotonic()
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise InvalidRequest("device 'cuda' was asked for, but CUDA is not available")
        dev = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else cfg.device
        self.device = torch.device("cpu" if dev == "auto" else dev)
        on_cuda = self.device.type == "cuda"
        dtype_name = cfg.dtype or ("bfloat16" if on_cuda else "float32")
        self.dtype = DTYPES[dtype_name]
        self.page_size = page_size = cfg.page_size or (16 if on_cuda else 1)
        # overlap pays off where the device computes while the host schedules; on CPU the
        # host does both, so each step's tokens are read at once
        self.overlap = on_cuda if cfg.overlap is None else cfg.overlap
        attention = "triton" if cfg.batch_invariant else cfg.attention_backend
        if attention == "triton":
            from engine.kernels import triton_unavailable

            if (reason := triton_unavailable(self.device.type)) is not None:
                what = "batch_invariant" if cfg.batch_invariant else "the triton attention backend"
                raise InvalidRequest(f"{what} needs the Triton kernels: {reason}")

        resolved = resolve(cfg.model, progress=progress)
        mcfg, _ = read_config(resolved.path)
        self.model_config = mcfg
        self.tokenizer = load_tokenizer(resolved.path, progress=progress)
        self.max_seq_len = cfg.max_seq_len or min(mcfg.max_position_embeddings, 8192)
        torch.manual_seed(cfg.seed)
        # tensor parallelism: the other ranks load their shards while this one loads its own
        self.leader = self._start_ranks(resolved.path, dtype_name, attention)
        self.model = build_model(
            resolved.path,
            mcfg,
            self.max_seq_len + page_size,
            self.dtype,
            self.device,
            load_format=cfg.load_format,
            progress=progress,
            seed=cfg.seed,
            tp=SINGLE if self.leader is None else self.leader.tp,
        )

        if cfg.residual_dtype is not None:
            self.model.residual_dtype = DTYPES[cfg.residual_dtype]
        self.model.set_batch_invariant(cfg.batch_invariant)
        self.num_pages = cfg.num_pages or self._default_num_pages()
        if self.leader is not None:
            self.leader.connect(self.num_pages)
        # one spare page past the allocator's range: CUDA-graph padding rows write their KV there
        self.pool = KVPool(
            mcfg.num_layers,
            self.num_pages + 1,
            page_size,
            self.model.num_kv_heads,  # this rank's share under tensor parallelism
            mcfg.head_dim,
            self.dtype,
            self.device,
        )
        self.table = PageTable(max_running_req, self.max_seq_len, page_size)
        cache: PrefixCache = (
            RadixCache(page_size) if cache_type == "radix" else NaiveCache(page_size)
        )
        self.kv = KVManager(self.num_pages, page_size, self.table, cache)
        self.scheduler = Scheduler(self.kv)
        backend = create_backend(
            attention,
            self.device,
            self.pool,
            self.model.num_heads,
            self.model.num_kv_heads,
            mcfg.head_dim,
        )
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.table,
            backend,
            self.device,
            cuda_graph=cfg.cuda_graph,
            pad_page=self.num_pages,
            leader=self.leader,
        )
        self._policies: dict[str, SchedulePolicy] = {n: p() for n, p in POLICIES.items()}
        eos = set(mcfg.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.info = EngineInfo(
            model=resolved.name,
            device=str(self.device),
            dtype=dtype_name,
            vocab_size=mcfg.vocab_size,
            page_size=page_size,
            num_pages=self.num_pages,
            max_running_req=max_running_req,
            max_seq_len=self.max_seq_len,
            cache_type=cache_type,
            attention_backend=backend.name,
            architecture=mcfg.architecture,
            overlap=self.overlap,
            residual_dtype=cfg.residual_dtype or dtype_name,
            batch_invariant=cfg.batch_invariant,
            tp_size=cfg.tp_size,
        )

        self._lock = threading.Lock()
        self._work = threading.Event()  # set when a command arrives, for an idle loop to wake
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_submits = 0  # the submits in _inbox, so num_waiting() needs no scan
        self._uids = itertools.count()
        self._live_uids: set[int] = set()  # submitted and not yet ended
        self._aborting: set[int] = set()
        self._collect: dict[int, dict[str, Any] | None] = {}  # uids whose outputs generate() wants
        self._step_no = 0
        self._inflight: _InFlight | None = None  # with overlap: launched, tokens not yet read
        # sampling their last token: pages and row already given back, final token not read yet
        self._finishing: dict[int, Req] = {}
        self._step_hooks: list[Hook] = []
        self._event_hooks: list[Hook] = []
        self._wait_hooks: list[Callable[[], None]] = []

    # -- facts ---------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds on the engine's monotonic clock, 0 at engine start."""
        return time.monotonic() - self._t_start

    def config_dict(self) -> dict[str, Any]:
        live = self._live
        return {"max_extend_tokens": live.max_extend_tokens, "policy": live.policy}

    def kv_stats(self) -> KVStats:
        return self.kv.stats(self.scheduler.reserved_tokens())

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

    def queue_stats(self) -> QueueStats:
        return QueueStats(self.scheduler.num_waiting, self.scheduler.num_running)

    def num_waiting(self) -> int:
        return self._inbox_submits + self.scheduler.num_waiting  # two counters: O(1)

    @property
    def in_flight(self) -> bool:
        """A step was launched and its tokens are still to be applied (overlap only)."""
        return self._inflight is not None

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work() or self._inflight is not None

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a command arrives (or the timeout passes); True if there is work."""
        if self.has_work():
            return True
        self._work.wait(timeout)
        self._work.clear()
        return self.has_work()

    def check_integrity(self) -> None:
        self.scheduler.check_counters()
        self.kv.check_integrity(self.scheduler.active_rows())

    def integrity_snapshot(self) -> KVSnapshot:
        """Engine thread, between steps: the counter checks (O(rows); raise AssertionError) and
        a copy of the page accounting whose full check, `.check()`, may run on another thread."""
        self.scheduler.check_counters()  # O(queue), which --max-waiting bounds
        self.kv.check_counters()
        return self.kv.snapshot(self.scheduler.active_rows())

    def _default_num_pages(self) -> int:
        m = self.model_config
        # this rank's KV heads: under tensor parallelism rank 0 holds the most
        kv_heads = self.model.num_kv_heads
        per_token = KVPool.bytes_per_token(m.num_layers, kv_heads, m.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.8)
        else:
            budget = CPU_KV_BYTES
        tokens = min(budget // per_token, self.config.max_running_req * self.max_seq_len)
        return max(tokens // self.page_size, pages_for(self.max_seq_len, self.page_size))

    def _start_ranks(self, path: Path, dtype_name: str, attention: str) -> Leader | None:
        """With tp_size > 1, start the worker ranks (engine.distributed); None otherwise."""
        cfg = self.config
        if cfg.tp_size == 1:
            return None
        from engine.distributed import start_leader

        return start_leader(
            model_path=path, mcfg=self.model_config, device=self.device, dtype=dtype_name,
            max_positions=self.max_seq_len + self.page_size, load_format=cfg.load_format,
            seed=cfg.seed, residual_dtype=cfg.residual_dtype, page_size=self.page_size,
            max_running_req=cfg.max_running_req, max_seq_len=self.max_seq_len,
            attention=attention, cuda_graph=cfg.cuda_graph, overlap=self.overlap,
            tp_size=cfg.tp_size,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any; the engine cannot step after.
        (A process that exits stops them too.)"""
        if self.leader is not None:
            self.leader.close()

    # -- hooks ---------------------------------------------------------------------------
    def add_step_hook(self, fn: Callable[[StepRecord], None]) -> None:
        self._step_hooks.append(fn)

    def add_event_hook(self, fn: Callable[[EngineEvent], None]) -> None:
        """fn sees every event in protocol order: at step start `queued` / `aborted` /
        `rejected`; after the forward the step record, its tokens, then its request events."""
        self._event_hooks.append(fn)

    def add_wait_hook(self, fn: Callable[[], None]) -> None:
        """fn runs on the engine thread when it is about to wait for the device to finish a
        step. Work handed to another thread there (the server's events) runs while the device
        computes, instead of taking the GIL from the engine thread while it schedules."""
        self._wait_hooks.append(fn)

    def _emit(self, events: list[EngineEvent]) -> None:
        for ev in events:
            self._call(self._event_hooks, ev)
            if isinstance(ev, StepRecord):
                self._call(self._step_hooks, ev)

    @staticmethod
    def _call(hooks: list[Hook], ev: EngineEvent) -> None:
        for fn in hooks:
            try:
                fn(ev)
            except Exception:  # an observer must never take the engine down
                log.exception("hook %r failed", fn)

    # -- commands (any thread) -----------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidRequest("the prompt is empty")
            if chat:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                return list(self.tokenizer.encode(text, add_special_tokens=False))
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise InvalidRequest(
                f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
            )
        if chat:
            raise InvalidRequest("chat=True needs a text prompt, not token ids")
        ids = list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequest(f"token ids must be integers in [0, {vocab}), got {t!r}")
        return ids

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        total = prompt_len + max_tokens
        if total > self.max_seq_len:
            raise TooLarge(
                f"{prompt_len} prompt tokens plus max_tokens={max_tokens} is {total} tokens, "
                f"beyond max_seq_len={self.max_seq_len}"
            )
        need = pages_for(total, self.page_size)
        if need > self.num_pages:
            raise TooLarge(
                f"the request needs {need} KV pages; the whole pool has {self.num_pages}"
            )

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
        self._work.set()
        return uid

    def abort(self, uid: int) -> None:
        """Stop a request; a step already running finishes, no later step lists it."""
        with self._lock:
            if uid not in self._live_uids or uid in self._aborting:
                raise NotFound(f"no request with uid {uid} is in flight")
            self._aborting.add(uid)
            self._inbox.append(("abort", uid))
        self._work.set()

    def set_config(
        self, max_extend_tokens: int | None = None, policy: str | None = None
    ) -> dict[str, Any]:
        """Change the budget and/or the policy from the next step on; invalid values change nothing."""
        if max_extend_tokens is not None:
            check_budget(max_extend_tokens)
        if policy is not None:
            check_policy(policy)
        with self._lock:
            cur = self._live
            self._live = LiveConfig(
                cur.max_extend_tokens if max_extend_tokens is None else max_extend_tokens,
                cur.policy if policy is None else policy,
            )
        return self.config_dict()

    # -- the engine loop (one thread) ----------------------------------------------------
    def _drain_inbox(self) -> list[EngineEvent]:
        with self._lock:
            inbox, self._inbox, self._inbox_submits = self._inbox, [], 0
        events: list[EngineEvent] = []
        t = self.now()
        for kind, arg in inbox:
            if kind == "submit":
                uid, ids, params, source = arg
                gen = None
                if params.seed is not None:
                    gen = torch.Generator(device=self.device).manual_seed(params.seed)
                detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                state = RequestState(uid, ids, params, t, detok, generator=gen)
                self.scheduler.add(state)
                fields = {"prompt_len": len(ids), "max_tokens": params.max_tokens}
                if source is not None:
                    fields["source"] = source
                events.append(RequestEvent(uid, "queued", t, fields))
            else:
                uid = arg
                state = self.scheduler.abort(uid)
                if state is None and (req := self._finishing.pop(uid, None)) is not None:
                    state = req.state  # its pages are back already; its last token is dropped
                if state is not None:
                    state.aborted = True  # a step in flight must not give it a token
                    # its figures as far as it got: an API ending it on a stop string counts it
                    fields = {"output_len": len(state.output_ids), **self._metrics(state)}
                    events.append(RequestEvent(uid, "aborted", t, fields))
                    self._end(uid, state)
        return events

    def step(self) -> StepRecord | None:
        """Run one engine step and return the record of the step that completed in this call,
        or None. Without overlap that is the step just scheduled. With overlap the step just
        scheduled is launched and left running, and the one launched by the previous call is
        completed while it runs; the first call of a burst then returns None with work still
        in flight (`has_work()`)."""
        if self.leader is not None:
            self.leader.check()  # a dead rank ends the engine, even an idle one
        pre = self._drain_inbox()
        if not self.overlap:
            self._emit(pre)
        live = self._live
        t0 = self.now()
        scheduled = self.scheduler.schedule(self._policies[live.policy], live.max_extend_tokens, t0)
        prev, launched = self._inflight, None
        if scheduled is not None:
            batch = scheduled.batch
            items = tuple(
                StepItem(r.uid, batch.kind(r), r.cached_len, r.device_len) for r in batch.reqs
            )
            # the pool and queue as this step left them: its batch admitted and allocated
            kv, queue = self.kv_stats(), self.queue_stats()
            out = self.runner.launch(batch, prev.out if prev is not None else None)
            launched = _InFlight(batch, items, scheduled.admitted, out, live, t0, kv, queue)
        if not self.overlap:
            if launched is None:
                return None
            self._advance(launched.batch)
            return self._complete(launched)
        self._inflight = launched
        record = self._complete(prev) if prev is not None else None
        # after the previous step's tokens are applied: every token this step was fed is known
        # on the host, so a request sampling its last token can give its pages back now
        if launched is not None:
            self._advance(launched.batch)
        # this call's queued / aborted events follow the record of the step that was already
        # running when they were applied
        self._emit(pre)
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
            self._finishing[req.uid] = req

    def _complete(self, step: _InFlight) -> StepRecord:
        """Read a launched step's tokens and apply them: outputs, finishes, the step record and
        its events."""
        if self._wait_hooks and not step.out.done():
            for fn in self._wait_hooks:
                try:
                    fn()
                except Exception:  # as for event hooks: never the engine's failure
                    log.exception("wait hook %r failed", fn)
        tokens = step.out.result()
        logprobs = step.out.logprob_rows()
        for req, rows in step.out.prompt_rows():
            req.state.prompt_logprobs += [[lp, top] for lp, top in rows]
        t1 = self.now()
        post: list[EngineEvent] = []
        req_events = [
            RequestEvent(r.uid, "admitted", step.t0, {"cached_len": r.state.cached_len})
            for r in step.admitted
        ]
        finished = []
        gone: set[int] = set()
        for i, (req, tok) in enumerate(zip(step.out.reqs, tokens, strict=True)):
            st = req.state
            if st.aborted or st.finish_reason is not None:
                # it ended while this step ran (aborted, or an EOS read one step late): the
                # token is dropped, and its item is marked wasted
                gone.add(req.uid)
                continue
            req.append_token(tok, t1)
            token = TokenEvent(req.uid, t1, tok, st.detok.push(tok))
            if logprobs is not None and st.params.logprobs is not None:
                lp, top = logprobs[i]
                token = replace(token, logprob=lp, top_logprobs=top[: st.params.logprobs])
                st.output_logprobs.append([lp, token.top_logprobs])
            post.append(token)
            if len(st.output_ids) == 1:
                first = {} if st.params.prompt_logprobs is None else self._prompt_lp(st)
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
            if self._finishing.pop(req.uid, None) is None:  # an EOS before its last token
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
            self._end(st.uid, st)

        items = step.items
        gone |= {r.uid for r in step.batch.reqs if r.state.aborted}  # chunks don't sample
        if gone:  # the device did this work; the record says it was thrown away
            items = tuple(replace(it, wasted=True) if it.uid in gone else it for it in items)
        record = StepRecord(
            step=self._step_no,
            t0=step.t0,
            t1=t1,
            phase=step.batch.phase,
            budget=step.live.max_extend_tokens,
            policy=step.live.policy,
            items=items,
            kv=step.kv,
            queue=step.queue,
            ranks=step.out.rank_times(),
        )
        self._step_no += 1
        self._emit([record, *post, *req_events])
        return record

    @staticmethod
    def _prompt_lp(st: RequestState) -> dict[str, Any]:
        k = st.params.prompt_logprobs
        return {"prompt_logprobs": [[lp, top[:k]] for lp, top in st.prompt_logprobs]}

    def _metrics(self, st: RequestState) -> dict[str, Any]:
        m = request_metrics(st.t_queued, st.t_admitted, st.token_times)
        m.pop("inter_token_latency_seconds")  # the token events carry those
        return m

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
            **({} if st.params.prompt_logprobs is None else self._prompt_lp(st)),
            "metrics": request_metrics(st.t_queued, st.t_admitted, st.token_times),
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
        while self._inflight is not None and not self._inbox and not self.scheduler.has_work():
            self.step()
        with self._lock:
            return [self._collect.pop(u) for u in uids]  # type: ignore[misc]
