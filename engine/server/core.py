"""`python -m engine.server`: the composition root that wires the engine to the WebSocket server.

The engine loop (loop.py) runs in the main thread and sleeps on an event while idle. The publisher
(instrumentation.publisher) runs an asyncio server in another thread, and the HTTP API
(openai_api.py) a third. The command line comes from the settings' dataclasses (args.py). This
package is the only place that imports both the engine and instrumentation.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.server.args import ServerArgs, build_parser, parse_args
from engine.server.loop import GIL_SWITCH_INTERVAL_S, CommandHandler, EngineLoop
from instrumentation import messages
from instrumentation.errors import EngineError
from instrumentation.fold import Fold
from instrumentation.publisher import Publisher, PublisherConfig
from instrumentation.trace import TraceWriter

if TYPE_CHECKING:
    from engine.server.openai_api import HttpApi

__all__ = ["EngineLoop", "Server", "ServerArgs", "build", "build_parser", "main", "serve"]

log = logging.getLogger("stepscope.server")
Args = ServerArgs | argparse.Namespace  # build() also takes build_parser().parse_args(...)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # no line per connection

    from engine import LLM

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    for port in (args.port, args.http_port):
        try:  # fail before a long model load, not after it
            if port is not None:
                _check_port(args.host, port)
        except OSError as exc:
            print(f"stepscope: cannot listen on {args.host}:{port}: {exc}", file=sys.stderr)
            return 2
    print(f"stepscope: loading {args.model} on {args.device} ...", file=sys.stderr, flush=True)
    try:
        llm = LLM.from_config(args.engine(), progress=True)
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
    history: Fold  # what a late client's `hello` carries
    trace: TraceWriter | None
    http: HttpApi | None = None  # the OpenAI-compatible API; None with --http-port none

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        self.publisher.stop()
        if self.trace is not None:
            self.trace.close()


def build(llm: Any, args: Args) -> Server:
    """History, trace, publisher, engine loop and command handler around `llm` (not attached)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # the model, tokenizer and imports are hundreds of thousands of objects that live for good:
    # out of the collector's sight, a full collection walks only what serving creates
    gc.freeze()
    max_frame = 2**20
    # the shared fold with the server's bounds: the last --history-steps steps, every request in
    # flight, ended requests up to a count and a byte budget
    history = Fold(max_steps=args.history_steps, config=llm.config_dict())
    # `instance` tells a reconnecting client whether it meets the engine it knew (v1.1)
    engine_facts = {**llm.info.to_dict(), "max_frame_bytes": max_frame,
                    "max_waiting": args.max_waiting,
                    "instance": uuid.uuid4().hex[:12],
                    # the wall-clock time at which the engine's clock read 0: engines on one
                    # machine (a fleet) are drawn on one clock by it
                    "clock_epoch": time.time() - llm.now()}  # fmt: skip

    def hello() -> dict[str, Any]:
        # server thread: the fold has folded every broadcast up to `history.seq`
        return messages.hello(
            llm.now(), engine_facts, dict(history.config), history.history(), history.seq
        )

    sinks: list[Callable[[dict[str, Any], str], None]] = [lambda msg, _text: history.apply(msg)]
    trace = TraceWriter(args.trace) if args.trace else None
    if trace is not None:
        trace.write(json.dumps(hello()))  # the header: engine facts and the starting config
        sinks.append(trace)
    http = _http_api(llm, args)
    if http is not None:  # its router and Prometheus metrics see every message
        sinks.extend(http.sinks)
    config = PublisherConfig(
        host=args.host, port=args.port, token=args.token,
        allowed_origins=tuple(args.allow_origin or ()), max_frame_bytes=max_frame,
        client_queue=args.client_queue, drop_limit=args.client_drop_limit,
    )  # fmt: skip
    publisher = Publisher(config, hello=hello, sinks=sinks)
    engine_loop = EngineLoop(llm, publisher.publish)
    publisher.on_frame = CommandHandler(llm, engine_loop, publisher, args.max_waiting).on_frame
    if http is not None:
        http.wake, http.call = engine_loop.wake.set, engine_loop.call
    return Server(llm, publisher, engine_loop, history, trace, http)


def _http_api(llm: Any, args: Args) -> HttpApi | None:
    if getattr(args, "http_port", None) is None:
        return None
    from engine.server.openai_api import build_http_api  # prometheus-client, only when on

    return build_http_api(
        llm, host=args.host, port=args.http_port, token=args.token,
        allowed_origins=tuple(args.allow_origin or ()), max_waiting=args.max_waiting,
        model_arg=str(args.model), app=_web_app,
        metrics_token=getattr(args, "metrics_token", None),
        generation_config=getattr(args, "generation_config", "auto"),
        metrics_compat=getattr(args, "metrics_compat", None),
    )  # fmt: skip


def _web_app(api: HttpApi) -> Any:
    from engine.server.openai_app import build_app  # Starlette, only when the API serves

    return build_app(api)


def serve(llm: Any, args: Args) -> int:
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
