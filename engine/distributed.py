"""Tensor parallelism across processes: rank 0 (the engine's own process) schedules, every rank
runs every step over its shard of the model.

`Leader` is rank 0's side. It spawns one worker process per other rank (torch.multiprocessing,
spawn), joins them in a torch.distributed process group (NCCL on CUDA, gloo on CPU; rank r uses
cuda:r), and before every step broadcasts the step's `StepPlan` (engine.plan): a few lists of
ints over a separate gloo group, so that waiting for it never touches a GPU. A worker applies
the plan's new page-table entries (engine.kvcache.table_sync) to its copy of the table and runs
the same `execute` over its heads; the collectives inside the model keep the ranks in step. Only rank 0 samples; with
overlap it also broadcasts the sampled tokens, which the next step's inputs are patched from.

Each rank times its part of every step and files the times in a small shared-memory table that
rank 0 reads when it completes the step: a collective for them would add a synchronization the
step does not otherwise need.

Faults end the engine instead of hanging it: a watchdog thread on rank 0 waits on the workers'
process sentinels and turns a death into `RankDied` (gloo's collectives fail at once when a
peer's socket closes; NCCL's are aborted), and a worker whose parent is gone exits.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention.registry import create_backend
from engine.kvcache.pool import KVPool
from engine.kvcache.table import PageTable
from engine.models.config import ModelConfig
from engine.models.loader import build_model, read_config
from engine.models.parallel import TPRank, head_shard
from engine.plan import RankClock, RankTimes, StepPlan
from engine.runner import ModelRunner
from instrumentation.errors import EngineError, InvalidRequest
from instrumentation.records import RankTiming

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# workers wait for the next plan this long while the engine idles (a gloo wait cannot be
# endless); a dead rank 0 is noticed at once through its closed socket, not through this
IDLE_TIMEOUT = datetime.timedelta(days=30)
# a collective that waits longer fails: generous, since FlashInfer's first-use JIT (a minute)
# can hold one rank inside a step while the others wait in its first all-reduce
DEFAULT_TIMEOUT_S = 600.0
TIMES_RING = 256  # steps of rank times kept: rank 0 reads a step's within a few steps
# A worker files a step's times right after its last collective of the step, which rank 0 has
# also passed, so they are there at once or nearly; this bound only guards against a stuck one
TIMES_WAIT_S = 5.0


class RankDied(EngineError):
    """A tensor-parallel worker process ended while the engine ran."""

    code = "internal"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its rank: every choice is rank 0's, made before its own
    model load so that all ranks load at the same time."""

    model_path: str
    device: str  # cpu | cuda
    dtype: str
    max_positions: int
    load_format: str
    seed: int
    residual_dtype: str | None
    page_size: int
    max_running_req: int
    max_seq_len: int
    attention: str
    cuda_graph: bool
    overlap: bool
    tp_size: int
    threads: int
    timeout_s: float  # a collective that waits longer than this fails


@dataclass(frozen=True, slots=True)
class Setup:
    """What rank 0 decides after its load and sends once: the pool's size."""

    num_pages: int


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def check_devices(device: str, tp_size: int) -> str | None:
    """Why tp_size ranks cannot run on `device`, or None."""
    if device == "cuda" and torch.cuda.device_count() < tp_size:
        return f"tp_size={tp_size} needs {tp_size} GPUs, {torch.cuda.device_count()} are visible"
    if torch.distributed.is_initialized():
        return "this process already has a torch.distributed process group"
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    return None


def start_leader(
    *,
    model_path: Path,
    mcfg: ModelConfig,
    device: torch.device,
    dtype: str,
    max_positions: int,
    load_format: str,
    seed: int,
    residual_dtype: str | None,
    page_size: int,
    max_running_req: int,
    max_seq_len: int,
    attention: str,
    cuda_graph: bool,
    overlap: bool,
    tp_size: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Leader:
    """Check that tp_size ranks can run this model here, then start the workers (they load
    their shards while the caller loads rank 0's)."""
    try:
        for rank in range(tp_size):  # every rank must get heads
            head_shard(mcfg.num_heads, mcfg.num_kv_heads, tp_size, rank)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if (reason := check_devices(device.type, tp_size)) is not None:
        raise InvalidRequest(f"tensor parallelism cannot start: {reason}")
    spec = WorkerSpec(
        model_path=str(model_path), device=device.type, dtype=dtype,
        max_positions=max_positions, load_format=load_format, seed=seed,
        residual_dtype=residual_dtype, page_size=page_size, max_running_req=max_running_req,
        max_seq_len=max_seq_len, attention=attention, cuda_graph=cuda_graph, overlap=overlap,
        tp_size=tp_size, threads=max(1, torch.get_num_threads() // tp_size), timeout_s=timeout_s,
    )  # fmt: skip
    leader = Leader(spec)
    if device.type == "cpu" and torch.get_num_threads() != spec.threads:
        # the ranks share the cores: each takes its part, or their matmuls fight for them;
        # close() gives the process its count back
        log.info("tensor parallelism on CPU: %d torch threads per rank", spec.threads)
        leader.restore_threads = torch.get_num_threads()
        torch.set_num_threads(spec.threads)
    return leader


class Leader:
    """Rank 0's handle on the other ranks: start them, send each step's plan, read their
    times, notice their death, stop them."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch.multiprocessing as mp

        self.spec = spec
        self.size = spec.tp_size
        self.tp = TPRank(0, self.size, None, timed=spec.device == "cpu")
        self.failure: str | None = None
        self.restore_threads: int | None = None  # rank 0's torch threads before the engine
        self._closing = False
        self._control: Any = None
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # port 0: the store picks a free port itself, no race with other servers
        self.store = torch.distributed.TCPStore(
            HOST, 0, self.size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        # [rank, step % ring] -> (seq, forward_s, comm_s); NaN where a rank measured nothing
        self.times = torch.full((self.size, TIMES_RING, 3), -1.0, dtype=torch.float64)
        self.times.share_memory_()
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, spec, self.store.port, self.times, os.getpid()),
                name=f"stepscope-tp{rank}",
                daemon=True,  # never outlive the engine
            )
            for rank in range(1, self.size)
        ]
        for p in self.procs:
            p.start()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.close)  # before multiprocessing's own exit hook ends the workers

    # -- start-up ------------------------------------------------------------------------
    def connect(self, num_pages: int) -> None:
        """Join the group once every worker has loaded its shard, and send the setup."""
        import torch.distributed as dist

        keys = [f"loaded/{rank}" for rank in range(1, self.size)]
        while not self.store.check(keys):  # polled: a worker that dies loading is noticed
            self.check()
            time.sleep(0.05)
        timeout = datetime.timedelta(seconds=self.spec.timeout_s)
        dist.init_process_group(
            backend_for(self.spec.device), store=self.store, rank=0, world_size=self.size,
            timeout=timeout,
        )  # fmt: skip
        self._control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._broadcast(Setup(num_pages))
        warm_up(self.spec.device, torch.device("cuda", 0) if self.spec.device == "cuda" else None)

    # -- every step ----------------------------------------------------------------------
    def publish(self, plan: StepPlan | None) -> None:
        """Send the next step to every rank (None: stop)."""
        self.check()
        self._broadcast(plan)

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """With overlap, the next step's inputs are patched from these on every rank."""
        if self.spec.overlap:
            torch.distributed.broadcast(tokens, src=0)

    def worker_times(self, seq: int) -> list[RankTiming]:
        out = []
        deadline = time.monotonic() + TIMES_WAIT_S
        for rank in range(1, self.size):
            row = self.times[rank, seq % TIMES_RING]
            while int(row[0]) != seq and time.monotonic() < deadline and self.failure is None:
                time.sleep(0.0002)
            got = row.tolist()
            if int(got[0]) != seq:
                out.append(RankTiming(rank, None, None))
                continue
            out.append(RankTiming(rank, _opt(got[1]), _opt(got[2])))
        return out

    # -- faults ----------------------------------------------------------------------------
    def check(self) -> None:
        if self.failure is not None:
            raise RankDied(self.failure)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a collective's failure after a worker's death into RankDied."""
        try:
            yield
        except RankDied:
            raise
        except RuntimeError as exc:  # what gloo and NCCL raise (DistBackendError is one)
            # gloo may report the closed socket before the dead rank's status can be read
            deadline = time.monotonic() + 2.0
            while self.failure is None and time.monotonic() < deadline:
                if (dead := self._dead()) is not None:
                    self.failure = dead
                time.sleep(0.01)
            if self.failure is not None:
                raise RankDied(self.failure) from exc
            raise

    def _dead(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                return (
                    f"tensor-parallel rank {rank} (pid {p.pid}) ended with {how}; the engine "
                    "cannot run without it and has stopped"
                )
        return None

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        # the sentinel fires as the process exits, a moment before its status can be read
        deadline = time.monotonic() + 5.0
        while (dead := self._dead()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.failure = dead or "a tensor-parallel rank ended; the engine has stopped"
        log.error("%s", self.failure)
        if self.spec.device == "cuda":
            # NCCL would wait for the dead rank until the collective timeout: abort instead,
            # so that the engine thread's pending collective fails now
            with contextlib.suppress(Exception):
                torch.distributed.distributed_c10d._abort_process_group()

    # -- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and leave the process group; safe to call twice."""
        if self._closing:
            return
        self._closing = True
        # a worker that joined waits for a plan: tell it to stop; one still starting is ended
        stop = self.failure is None and self._control is not None
        if stop:
            with contextlib.suppress(Exception):
                self._broadcast(None)
        # every rank leaves the group at about the same time, as the workers do on the stop
        if torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()
        for p in self.procs:
            if stop:
                p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=5)
        if self.restore_threads is not None:
            torch.set_num_threads(self.restore_threads)

    def _broadcast(self, obj: Any) -> None:
        torch.distributed.broadcast_object_list([obj], src=0, group=self._control)


def _opt(v: float) -> float | None:
    return None if v != v else v  # NaN: not measured


def warm_up(device: str, dev: torch.device | None) -> None:
    """On CUDA, one all-reduce builds the NCCL communicator before any graph is captured."""
    if device != "cuda":
        return
    x = torch.zeros(1, device=dev)
    torch.distributed.all_reduce(x)
    torch.cuda.synchronize(dev)


# -- the worker process ------------------------------------------------------------------------
def worker_main(rank: int, spec: WorkerSpec, port: int, times: torch.Tensor, parent: int) -> None:
    """A worker rank: build the shard, then run every plan rank 0 broadcasts until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s rank{rank} %(name)s: %(message)s"
    )
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        _serve(rank, spec, port, times)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    print("stepscope: rank 0 is gone; worker exits", file=sys.stderr, flush=True)
    os._exit(1)


def _serve(rank: int, spec: WorkerSpec, port: int, times: torch.Tensor) -> None:
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    cuda = spec.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, spec.dtype)
    tp = TPRank(rank, spec.tp_size, None, timed=not cuda)
    path = Path(spec.model_path)
    mcfg, _ = read_config(path)
    torch.manual_seed(spec.seed)
    model = build_model(
        path, mcfg, spec.max_positions, dtype, device, spec.load_format, False, spec.seed, tp
    )
    if spec.residual_dtype is not None:
        model.residual_dtype = getattr(torch, spec.residual_dtype)

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(HOST, port, spec.tp_size, is_master=False, timeout=timeout)
    store.set(f"loaded/{rank}", "1")
    dist.init_process_group(
        backend_for(spec.device), store=store, rank=rank, world_size=spec.tp_size, timeout=timeout
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    setup = _receive(control)
    assert isinstance(setup, Setup)
    warm_up(spec.device, device)

    pool = KVPool(
        mcfg.num_layers, setup.num_pages + 1, spec.page_size, model.num_kv_heads,
        mcfg.head_dim, dtype, device,
    )  # fmt: skip
    table = PageTable(spec.max_running_req, spec.max_seq_len, spec.page_size)
    backend = create_backend(
        spec.attention, device, pool, model.num_heads, model.num_kv_heads, mcfg.head_dim
    )
    runner = ModelRunner(
        model, pool, table, backend, device, cuda_graph=spec.cuda_graph, pad_page=setup.num_pages
    )
    clock = RankClock(model, device)
    files = _TimesFiler(times, rank, cuda)
    prev: torch.Tensor | None = None
    with torch.inference_mode():
        while (plan := _receive(control)) is not None:
            assert isinstance(plan, StepPlan)
            runner.apply_table(plan)
            clock.start()
            runner.execute(plan, prev)
            prev = None
            if spec.overlap and plan.sample:
                # the tokens rank 0 samples: the next plan may patch its inputs from them
                prev = torch.empty(len(plan.sample), dtype=torch.int64, device=device)
                dist.broadcast(prev, src=0)
            files.file(plan.seq, clock.stop())
    files.close()
    dist.destroy_process_group()


def _receive(group: Any) -> Any:
    box: list[Any] = [None]
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return box[0]


class _TimesFiler:
    """Writes a worker's step times into the shared table: at once on CPU; on CUDA from a
    thread that waits for each step's end event, so the loop never waits for the device."""

    def __init__(self, times: torch.Tensor, rank: int, cuda: bool) -> None:
        import queue

        self.times, self.rank = times, rank
        self._queue: queue.SimpleQueue[tuple[int, RankTimes] | None] | None = None
        if cuda:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._drain, name="tp-times", daemon=True).start()

    def file(self, seq: int, t: RankTimes) -> None:
        if self._queue is not None:
            self._queue.put((seq, t))
        else:
            self._write(seq, t.seconds())

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)

    def _drain(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            seq, t = item
            self._write(seq, t.seconds())

    def _write(self, seq: int, seconds: tuple[float | None, float | None]) -> None:
        forward_s, comm_s = seconds
        slot = self.times[self.rank, seq % TIMES_RING]
        nan = float("nan")
        # the times first, the step number last: rank 0 reads a slot once its number matches
        slot[1] = nan if forward_s is None else forward_s
        slot[2] = nan if comm_s is None else comm_s
        slot[0] = float(seq)
