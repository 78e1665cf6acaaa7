"""`python -m engine.server`: the composition root of the engine process and the API process.

This process loads the model and runs the engine loop (loop.py) in its main thread; it spawns
the API process (frontend.py: the WebSocket protocol, the HTTP API, tokenizing, the folds) at
the start, so that process's imports overlap the model load, and talks to it over ZMQ
(bridge.py here, client.py there). SIGINT or SIGTERM stops the engine, which then tells the API
process to stop (END) and waits for it; an API process that exits stops the engine. The
command line comes from the settings' dataclasses (args.py). This package is the only place
that imports both the engine and instrumentation.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.server.args import ServerArgs, build_parser, parse_args
from engine.server.bridge import ApiProcess, EngineBridge
from engine.server.loop import GIL_SWITCH_INTERVAL_S, EngineLoop
from instrumentation.errors import EngineError

__all__ = ["EngineLoop", "Server", "ServerArgs", "build", "build_parser", "main", "serve"]

log = logging.getLogger("stepscope.server")
Args = ServerArgs | argparse.Namespace  # build() also takes build_parser().parse_args(...)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # no line per connection

    for port in (args.port, args.http_port):
        try:  # fail before a long import and model load, not after them
            if port is not None:
                _check_port(args.host, port)
        except OSError as exc:
            print(f"stepscope: cannot listen on {args.host}:{port}: {exc}", file=sys.stderr)
            return 2
    if args.threads is not None:  # before torch is imported, and for the API process too
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # so the engine build keeps it
    # the sockets' directory, only this user's (mkdtemp: mode 0700)
    directory = tempfile.mkdtemp(prefix="stepscope-")
    # spawned before torch is imported here: its imports overlap this process's (about 1 s of
    # torch) and the model load
    api = ApiProcess(api_settings(args, directory))
    try:
        print(f"stepscope: loading {args.model} on {args.device} ...", file=sys.stderr, flush=True)
        try:
            from engine import LLM

            if args.threads is not None:
                import torch

                torch.set_num_threads(args.threads)
            llm = LLM.from_config(args.engine(), progress=True)
        except KeyboardInterrupt:
            return 130
        except EngineError as exc:
            print(f"stepscope: cannot start the engine: {exc}", file=sys.stderr)
            return 2
        return serve(llm, args, api=api, directory=directory)
    finally:
        api.stop(graceful=False)  # at once, if anything above failed; else it has exited
        shutil.rmtree(directory, ignore_errors=True)


def _check_port(host: str, port: int) -> None:
    """Raise OSError if nothing could listen on host:port now (the real bind comes later)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


def api_settings(args: Args, directory: str) -> dict[str, Any]:
    """What the API process is started with (on its stdin: tokens stay out of argv)."""
    return {
        "ipc": directory,
        "model": str(args.model),
        "host": args.host,
        "port": args.port,
        "token": args.token,
        "allow_origin": list(args.allow_origin or ()),
        "http_port": getattr(args, "http_port", None),
        "max_waiting": args.max_waiting,
        "history_steps": args.history_steps,
        "client_queue": args.client_queue,
        "client_drop_limit": args.client_drop_limit,
        "client_socket_buffer": getattr(args, "client_socket_buffer", None),
        "engine_gone_grace": getattr(args, "engine_gone_grace", ServerArgs.engine_gone_grace),
        "trace": args.trace,
        "metrics_token": getattr(args, "metrics_token", None),
        "metrics_compat": getattr(args, "metrics_compat", None),
        "generation_config": getattr(args, "generation_config", "auto"),
        "delays": getattr(args, "delays", True),
    }


@dataclass
class Server:
    """The engine process's parts; `build` makes them without starting anything."""

    llm: Any
    loop: EngineLoop
    bridge: EngineBridge
    settings: dict[str, Any]  # the API process's
    api: ApiProcess | None = None
    api_status: int | None = None  # the API process's exit status, once it exited
    _closing: bool = field(default=False, repr=False)

    @property
    def urls(self) -> dict[str, str | None]:
        """The API process's addresses: `ws` and `http` (None with --http-port none)."""
        return self.bridge.urls

    def start(self, api: ApiProcess | None = None) -> bool:
        """Answer the API process's calls; spawn it (or adopt the one given) and wait until it
        serves. False if it exited instead (it said why: a port already taken, say)."""
        self.bridge.start()
        self.api = api or ApiProcess(self.settings)
        if not self.api.wait_ready(self.bridge):
            self.api_status = self.api.exited()
            return False
        threading.Thread(target=self._watch_api, name="stepscope-api-watch", daemon=True).start()
        return True

    def _watch_api(self) -> None:
        assert self.api is not None
        status = self.api.proc.wait()
        if not self._closing:
            self.api_status = status
            print(f"stepscope: the API process exited (status {status}); stopping the engine",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.loop.stop()

    def close(self) -> None:
        """After the loop: tell the API process the engine stopped (after the last events),
        wait for it, and release the sockets."""
        self._closing = True
        self.bridge.end()
        if self.api is not None:
            status = self.api.stop()
            self.api_status = status if self.api_status is None else self.api_status
        self.bridge.close()
        shutil.rmtree(self.settings["ipc"], ignore_errors=True)


def build(llm: Any, args: Args, directory: str | None = None) -> Server:
    """The engine loop and the bridge around `llm`, their sockets in `directory` (a new
    private one if None); nothing started."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # the model, tokenizer and imports are hundreds of thousands of objects that live for good:
    # out of the collector's sight, a full collection walks only what serving creates
    gc.freeze()
    directory = directory or tempfile.mkdtemp(prefix="stepscope-")
    # `instance` tells a reconnecting client whether it meets the engine it knew (v1.1)
    hello = {**llm.info.to_dict(), "max_frame_bytes": 2**20, "max_waiting": args.max_waiting,
             "instance": uuid.uuid4().hex[:12],
             # the wall-clock time at which the engine's clock read 0: engines on one machine
             # (a fleet) are drawn on one clock by it
             "clock_epoch": time.time() - llm.now()}  # fmt: skip
    facts = {
        "info": llm.info.to_dict(),
        "hello": hello,
        "config": llm.config_dict(),
        "clock_start": time.monotonic() - llm.now(),
        "tokenizer": str(getattr(llm.tokenizer, "name_or_path", "") or ""),
        "model_dir": _model_dir(str(args.model)),
    }
    bridge = EngineBridge(llm, directory, facts, args.max_waiting)
    loop = EngineLoop(llm, bridge.publish)
    bridge.attach(loop)
    return Server(llm, loop, bridge, api_settings(args, directory))


def _model_dir(model: str) -> str | None:
    """The model's local directory (its generation_config.json), if it has one."""
    from engine.models.loader import resolve

    with contextlib.suppress(Exception):  # a dummy or odd model has no directory to read
        return str(resolve(model, progress=False).path)
    return None


def serve(llm: Any, args: Args, api: ApiProcess | None = None, directory: str | None = None) -> int:
    """Serve `llm` until SIGINT or SIGTERM (or the API process's exit); the exit status."""
    server = build(llm, args, directory)
    server.loop.attach()
    if not server.start(api):
        server.close()
        return 2 if server.api_status in (None, 2) else 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.loop.stop())
    print(f"stepscope engine ready at {server.urls['ws']}", flush=True)
    if server.urls.get("http") is not None:
        print(f"stepscope HTTP API at {server.urls['http']}", flush=True)
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
    if server.api_status not in (None, 0):
        status = 1
    print("stepscope: engine stopped", file=sys.stderr, flush=True)
    return status
