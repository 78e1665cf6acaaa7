"""`python -m engine.server`: the composition root that wires the engine to the WebSocket server.

The engine loop runs in the main thread and sleeps on an event while idle. The publisher
(instrumentation.publisher) runs an asyncio server in another thread: commands reach the engine
through `LLM`'s thread-safe methods, and events come back through an event hook that only
appends to a list, which is handed over once per step. This is the only engine module that
imports instrumentation.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from engine.config import CACHE_TYPES, POLICY_NAMES
from instrumentation import messages
from instrumentation.commands import (
    Abort,
    CommandError,
    KVMap,
    SetConfig,
    Stats,
    Submit,
    parse_command,
)
from instrumentation.errors import EngineError
from instrumentation.publisher import Client, Publisher, PublisherConfig, is_loopback
from instrumentation.recorder import Recorder
from instrumentation.trace import TraceWriter

if TYPE_CHECKING:
    from engine.server.openai_api import HttpApi

log = logging.getLogger("stepscope.server")

# Events are handed to the server thread at most this often (and whenever the engine idles):
# each hand-over wakes that thread, which then holds the GIL the engine needs, so a fast engine
# (milliseconds per step) should pay for it once per few steps, not every step.
FLUSH_INTERVAL_S = 0.01
# While the server thread serializes a batch of events it holds the GIL; the engine thread,
# back from launching a step, then waits until the interpreter switches threads: 5 ms by
# default, longer than a decode step on a GPU. A shorter interval bounds that wait.
GIL_SWITCH_INTERVAL_S = 0.0005


class EngineLoop:
    """Steps the engine while there is work; hands each step's events to the publisher."""

    def __init__(self, llm: Any, publish: Callable[[list[Any]], None]) -> None:
        self.llm = llm
        self.publish = publish
        self.wake = threading.Event()  # set by every command, so an idle loop never spins
        self.steps = 0
        self.errors = 0
        self._pending: list[Any] = []
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._stopping = False
        self._last_flush = 0.0
        # The whole event hook: no serializing or I/O on the engine thread (see `attach`).
        self.on_event: Callable[[Any], None] = self._pending.append

    def attach(self) -> EngineLoop:
        self.llm.add_event_hook(self.on_event)
        if hasattr(self.llm, "add_wait_hook"):
            # hand the events over while the engine waits for the device: the server thread
            # then serializes them in time the engine thread does not need
            self.llm.add_wait_hook(self.flush)
        return self

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps (for reads that need a quiet engine)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        self.wake.set()
        return future

    def stop(self) -> None:
        self._stopping = True
        self.wake.set()

    def run(self) -> None:
        """Until `stop()`; re-raises an engine failure after publishing what it produced."""
        try:
            while not self._stopping:
                self.wake.clear()  # before looking for work, so a later command is not missed
                self._run_calls()
                record = self.run_once()
                if record is None and not self.llm.in_flight:
                    self.flush()
                    self.wake.wait(timeout=0.05 if self.llm.has_work() else 0.5)
        finally:
            self.flush()
            self._fail_calls()

    def run_once(self) -> Any:
        try:
            record = self.llm.step()
        except Exception:
            self.errors += 1
            self.flush()
            raise
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()
        if record is not None:
            self.steps += 1
        return record

    def flush(self) -> None:
        """Hand the events collected so far to the publisher."""
        self._last_flush = time.monotonic()
        if self._pending:
            batch = self._pending.copy()
            self._pending.clear()  # the same list: `on_event` is its bound `append`
            self.publish(batch)

    def _run_calls(self) -> None:
        if not self._calls.empty():
            self.flush()  # a call's reply must not overtake the events before it
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)

    def _fail_calls(self) -> None:
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            future.cancel()


class CommandHandler:
    """Turns one client frame into an engine call and a reply (runs on the server thread)."""

    def __init__(self, llm: Any, loop: EngineLoop, publisher: Publisher, max_waiting: int) -> None:
        self.llm = llm
        self.loop = loop
        self.publisher = publisher
        self.max_waiting = max_waiting
        self.vocab_size: int = llm.info.vocab_size

    async def on_frame(self, client: Client, frame: str | bytes) -> None:
        try:
            cmd = parse_command(frame, vocab_size=self.vocab_size, policies=POLICY_NAMES)
        except CommandError as exc:
            self.publisher.reply(client, messages.error(exc.command_id, exc.code, exc.message))
            return
        try:
            if isinstance(cmd, Submit):
                await self._submit(client, cmd)
            elif isinstance(cmd, Abort):
                self.llm.abort(cmd.uid)
                self.loop.wake.set()
                # the sender hears at once; every client sees the `aborted` event that follows
                self.publisher.reply(client, messages.accepted(cmd.id, cmd.uid))
            elif isinstance(cmd, SetConfig):
                self._set_config(cmd)
            elif isinstance(cmd, Stats):
                await self._stats(client, cmd)
            elif isinstance(cmd, KVMap):
                await self._kv_map(client, cmd)
        except EngineError as exc:
            code = exc.code if exc.code in messages.ERROR_CODES else "invalid_request"
            self.publisher.reply(client, messages.error(cmd.id, code, str(exc)))  # type: ignore[arg-type]
        except Exception:  # a bug here must still answer, and must not reach the engine loop
            log.exception("command %r failed", type(cmd).__name__)
            reason = "the server could not carry out this command"
            self.publisher.reply(client, messages.error(cmd.id, "invalid_request", reason))

    async def _submit(self, client: Client, cmd: Submit) -> None:
        if self.llm.num_waiting() >= self.max_waiting:
            reason = f"{self.max_waiting} requests are already waiting; try later"
            self.publisher.reply(client, messages.error(cmd.id, "capacity", reason))
            return
        # Off the server thread: tokenizing a long prompt must not hold up other clients.
        uid = await asyncio.to_thread(self.llm.submit, cmd.prompt, cmd.params, chat=cmd.chat)
        self.loop.wake.set()
        self.publisher.reply(client, messages.accepted(cmd.id, uid))

    def _set_config(self, cmd: SetConfig) -> None:
        values = self.llm.set_config(max_extend_tokens=cmd.max_extend_tokens, policy=cmd.policy)
        self.loop.wake.set()
        self.publisher.broadcast(messages.config(cmd.id, self.llm.now(), values))

    async def _kv_map(self, client: Client, cmd: KVMap) -> None:
        # Between two steps, on the engine thread: the page table and the tree hold still.
        values = await asyncio.wrap_future(self.loop.call(self.llm.kv_map))
        self.publisher.reply(client, messages.kv_map(cmd.id, values.pop("t"), values))

    async def _stats(self, client: Client, cmd: Stats) -> None:
        values = await asyncio.wrap_future(self.loop.call(self._engine_stats))
        if (snapshot := values.pop("snapshot")) is not None:  # page by page, off the engine
            values["integrity"] = await asyncio.to_thread(snapshot.verdict)
        values.update(self.publisher.counters())
        self.publisher.reply(client, messages.stats(cmd.id, self.llm.now(), values))

    def _engine_stats(self) -> dict[str, Any]:
        """Engine thread, between steps: the counters are checked (O(rows)) and the page
        accounting copied; `_stats` checks the copy page by page on another thread."""
        try:
            snapshot, integrity = self.llm.integrity_snapshot(), "ok"
        except AssertionError as exc:
            snapshot, integrity = None, f"failed: {exc}"
        return {
            "steps": self.loop.steps,
            "engine_errors": self.loop.errors,
            "integrity": integrity,
            "snapshot": snapshot,
            "kv": asdict(self.llm.kv_stats()),
            "queue": asdict(self.llm.queue_stats()),
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.server",
        description="Run the stepscope engine behind a WebSocket (see docs/protocol.md).",
    )
    add = p.add_argument
    add("--host", default="127.0.0.1", help="bind address; non-loopback needs --token")
    add("--port", type=int, default=8765, help="0 picks a free port (printed when ready)")
    add(
        "--token",
        default=os.environ.get("STEPSCOPE_TOKEN"),
        help="clients must present it (?token= or Authorization: Bearer); env STEPSCOPE_TOKEN",
    )
    add(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed besides localhost ones (repeatable)",
    )
    add("--model", default="smollm2", help="'smollm2' or a local Hugging Face directory")
    add("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    add("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    add(
        "--threads",
        type=_positive,
        default=None,
        help="torch CPU threads (default: torch's choice); 1 avoids stalls on a busy machine",
    )
    add("--max-extend-tokens", type=_positive, default=256, help="prompt tokens per step")
    add("--policy", default="prefill_first", choices=POLICY_NAMES)
    add("--page-size", type=_positive, default=None, help="default: 16 on CUDA, 1 on CPU")
    add("--cache-type", default="radix", choices=CACHE_TYPES)
    add(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay decode steps from captured CUDA graphs",
    )
    add(
        "--residual-dtype",
        default=None,
        choices=("float32",),
        help="keep the residual stream in float32 (default: the compute dtype)",
    )
    add(
        "--batch-invariant",
        action="store_true",
        help="Triton kernels whose rows ignore the batch: the same tokens alone or batched, "
        "chunked or whole (CUDA)",
    )
    add(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the device runs this one (default: on CUDA)",
    )
    add("--max-running-req", type=_positive, default=32)
    add("--num-pages", type=_positive, default=None)
    add("--max-seq-len", type=_positive, default=None)
    add(
        "--tp-size",
        type=_positive,
        default=1,
        help="split the model over this many ranks (processes; GPUs cuda:0.. on CUDA)",
    )
    add("--max-waiting", type=_positive, default=1024, help="waiting requests before `capacity`")
    add("--history-steps", type=_positive, default=2000, help="step messages kept for hello")
    add("--client-queue", type=_positive, default=4096, help="messages buffered per client")
    add(
        "--client-drop-limit",
        type=_positive,
        default=16384,
        help="messages a client may lose without catching up before it is disconnected",
    )
    add("--trace", metavar="FILE", help="write every published message to FILE as JSON lines")
    add(
        "--http-port",
        type=_http_port,
        default=8000,
        help="the OpenAI-compatible API and /metrics, on --host; 0 picks a free port (printed "
        "when ready), 'none' turns it off",
    )
    add(
        "--metrics-token",
        default=os.environ.get("STEPSCOPE_METRICS_TOKEN"),
        help="/metrics needs it as a Bearer token (default: /metrics is open, as vLLM's "
        "--api-key guards only /v1); env STEPSCOPE_METRICS_TOKEN",
    )
    add(
        "--metrics-compat",
        default=None,
        choices=("vllm",),
        help="also export vLLM's metric names (vllm:), labels and buckets, so vLLM's Grafana "
        "dashboards work unchanged",
    )
    add(
        "--generation-config",
        default="auto",
        choices=("auto", "vllm"),
        help="auto: the model's generation_config.json sampling defaults apply to requests "
        "that leave a field out; vllm: OpenAI's defaults (vLLM's switch)",
    )
    add(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights from the model's config.json (a model's shape, no weights)",
    )
    return p  # fmt: skip


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _http_port(text: str) -> int | None:
    if text.lower() == "none":
        return None
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] or 'none', got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not is_loopback(args.host) and not args.token:
        parser.error(f"--host {args.host} is not loopback: give --token so strangers can't connect")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # no line per connection

    from engine import LLM

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:  # fail before a long model load, not after it
        _check_port(args.host, args.port)
    except OSError as exc:
        print(f"stepscope: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.http_port is not None:
            _check_port(args.host, args.http_port)
    except OSError as exc:
        print(f"stepscope: cannot listen on {args.host}:{args.http_port}: {exc}", file=sys.stderr)
        return 2
    print(f"stepscope: loading {args.model} on {args.device} ...", file=sys.stderr, flush=True)
    try:
        llm = LLM(
            model=args.model, device=args.device, dtype=args.dtype,
            max_extend_tokens=args.max_extend_tokens, policy=args.policy,
            page_size=args.page_size, cache_type=args.cache_type,
            cuda_graph=args.cuda_graph, overlap=args.overlap,
            residual_dtype=args.residual_dtype, batch_invariant=args.batch_invariant,
            max_running_req=args.max_running_req, num_pages=args.num_pages,
            max_seq_len=args.max_seq_len, load_format=args.load_format, progress=True,
            tp_size=args.tp_size,
        )  # fmt: skip
    except KeyboardInterrupt:
        return 130
    except EngineError as exc:
        print(f"stepscope: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    return serve(llm, args)


def _check_port(host: str, port: int) -> None:
    """Raise OSError if nothing could listen on host:port now (the real bind comes later)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


@dataclass
class Server:
    """The parts `serve` wires together; `build` makes them without starting anything."""

    llm: Any
    publisher: Publisher
    loop: EngineLoop
    recorder: Recorder
    trace: TraceWriter | None
    http: HttpApi | None = None  # the OpenAI-compatible API; None with --http-port none

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        self.publisher.stop()
        if self.trace is not None:
            self.trace.close()


def build(llm: Any, args: argparse.Namespace) -> Server:
    """Recorder, trace, publisher, engine loop and command handler around `llm` (not attached)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # the model, tokenizer and imports are hundreds of thousands of objects that live for good:
    # out of the collector's sight, a full collection walks only what serving creates
    gc.freeze()
    max_frame = 2**20
    recorder = Recorder(max_steps=args.history_steps, config=llm.config_dict())
    # `instance` tells a reconnecting client whether it meets the engine it knew (v1.1)
    engine_facts = {**llm.info.to_dict(), "max_frame_bytes": max_frame,
                    "max_waiting": args.max_waiting,
                    "instance": uuid.uuid4().hex[:12]}  # fmt: skip

    def hello() -> dict[str, Any]:
        # server thread: the recorder has folded every broadcast up to `recorder.seq`
        return messages.hello(
            llm.now(), engine_facts, dict(recorder.config), recorder.history(), recorder.seq
        )

    sinks: list[Callable[[dict[str, Any], str], None]] = [lambda msg, _text: recorder.record(msg)]
    trace = TraceWriter(args.trace) if args.trace else None
    if trace is not None:
        trace.write(json.dumps(hello()))  # the header: engine facts and the starting config
        sinks.append(trace)
    http = _http_api(llm, args)
    if http is not None:  # its router and Prometheus metrics see every message
        sinks.extend(http.sinks)
    config = PublisherConfig(
        host=args.host, port=args.port, token=args.token,
        allowed_origins=tuple(args.allow_origin), max_frame_bytes=max_frame,
        client_queue=args.client_queue, drop_limit=args.client_drop_limit,
    )  # fmt: skip
    publisher = Publisher(config, hello=hello, sinks=sinks)
    engine_loop = EngineLoop(llm, publisher.publish)
    publisher.on_frame = CommandHandler(llm, engine_loop, publisher, args.max_waiting).on_frame
    if http is not None:
        http.wake, http.call = engine_loop.wake.set, engine_loop.call
    return Server(llm, publisher, engine_loop, recorder, trace, http)


def _http_api(llm: Any, args: argparse.Namespace) -> HttpApi | None:
    if getattr(args, "http_port", None) is None:
        return None
    from engine.server.openai_api import build_http_api  # Starlette, only when it is on

    return build_http_api(
        llm, host=args.host, port=args.http_port, token=args.token,
        allowed_origins=tuple(args.allow_origin), max_waiting=args.max_waiting,
        model_arg=str(args.model), metrics_token=getattr(args, "metrics_token", None),
        generation_config=getattr(args, "generation_config", "auto"),
        metrics_compat=getattr(args, "metrics_compat", None),
    )  # fmt: skip


def serve(llm: Any, args: argparse.Namespace) -> int:
    """Publish `llm` and run its loop until SIGINT or SIGTERM; returns the exit status."""
    server = build(llm, args)
    server.loop.attach()
    try:
        server.publisher.start()
    except OSError as exc:
        print(f"stepscope: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    if server.http is not None:
        try:
            server.http.start()
        except OSError as exc:
            print(f"stepscope: cannot listen on {server.http.url}: {exc}", file=sys.stderr)
            server.publisher.stop()
            return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.loop.stop())
    print(f"stepscope engine ready at {server.publisher.url}", flush=True)
    if server.http is not None:
        print(f"stepscope HTTP API at {server.http.url}", flush=True)
    status = 0
    try:
        server.loop.run()
    except Exception:
        log.exception("engine step failed; shutting down")
        status = 1
    finally:
        server.close()
        if hasattr(llm, "close"):  # tensor-parallel worker processes stop with the server
            llm.close()
    print("stepscope: engine stopped", file=sys.stderr, flush=True)
    return status
