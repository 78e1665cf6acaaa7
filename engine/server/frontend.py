"""`python -m engine.server.frontend`: the API process, which `python -m engine.server` spawns.

It serves the WebSocket protocol and the HTTP API (OpenAI, SGLang's worker routes, /metrics),
tokenizes, and folds the engine's event stream for them (the history a `hello` carries, the
Prometheus metrics, the trace file), so the engine process does no per-token or per-client work
beyond serializing each batch of events once. It talks to the engine over ipc.py's sockets.

Its settings come as JSON on stdin (tokens stay out of argv and the environment). It stops when
the engine sends END (the engine stopped: exit 0) or on SIGTERM. If the engine process dies
instead, open responses end with a 503, new requests get 503s for `--engine-gone-grace` seconds,
then it exits with status 1, so a supervisor sees the failure.
"""

from __future__ import annotations

import gc
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.server.client import EngineClient, EngineGone
from instrumentation import messages
from instrumentation.fold import Fold
from instrumentation.publisher import Publisher, PublisherConfig
from instrumentation.trace import TraceWriter

log = logging.getLogger("stepscope.server")


class ApiServer:
    """The API process's parts around a connected `EngineClient`; `start()` binds and serves."""

    def __init__(self, engine: EngineClient, settings: dict[str, Any]) -> None:
        from engine.server import ipc

        facts = engine.facts
        assert facts is not None
        self.engine = engine
        self.settings = settings
        # the shared fold with the server's bounds: what a late client's `hello` carries
        self.history = Fold(max_steps=settings["history_steps"], config=facts.config)
        sinks: list[Any] = [lambda msg, _text: self.history.apply(msg)]
        self.trace = TraceWriter(settings["trace"]) if settings.get("trace") else None
        if self.trace is not None:
            self.trace.write(json.dumps(self.hello()))  # the header: engine facts, config
            sinks.append(self.trace)
        self.http = None
        if settings.get("http_port") is not None:
            from engine.server.openai.api import build_http_api
            from engine.server.openai.app import build_app

            self.http = build_http_api(
                engine, host=settings["host"], port=settings["http_port"],
                token=settings.get("token"), allowed_origins=tuple(settings["allow_origin"]),
                max_waiting=settings["max_waiting"], model_arg=settings["model"], app=build_app,
                metrics_token=settings.get("metrics_token"),
                generation_config=settings["generation_config"],
                metrics_compat=settings.get("metrics_compat"),
                delays=settings.get("delays", True),
            )  # fmt: skip
            sinks.extend(self.http.sinks)  # its router and Prometheus metrics see every message
        config = PublisherConfig(
            host=settings["host"], port=settings["port"], token=settings.get("token"),
            allowed_origins=tuple(settings["allow_origin"]),
            max_frame_bytes=facts.hello["max_frame_bytes"],
            client_queue=settings["client_queue"], drop_limit=settings["client_drop_limit"],
            socket_buffer=settings.get("client_socket_buffer"),
        )  # fmt: skip
        self.publisher = Publisher(
            config, hello=self.hello, sinks=sinks, loads=ipc.loads,
            delays=settings.get("delays", True),
        )  # fmt: skip
        from engine.server.commands import CommandHandler

        self.publisher.on_frame = CommandHandler(engine, self.publisher).on_frame
        engine.on_events = self.publisher.publish_serialized

    def hello(self) -> dict[str, Any]:
        """The publisher thread's: the fold has folded every broadcast up to `history.seq`."""
        facts = self.engine.facts
        assert facts is not None
        h = self.history
        return messages.hello(self.engine.now(), facts.hello, dict(h.config), h.history(), h.seq)

    def start(self) -> None:
        """Bind and serve (OSError if a port is taken), on the engine client's loop: an event
        batch is parsed, folded and written to every stream in one turn of one thread, with no
        hop between threads and no wait for another thread's turn with the GIL."""
        self.publisher.start(self.engine.loop)
        if self.http is not None:
            try:
                self.http.start(self.engine.loop)
            except OSError:
                self.publisher.stop()
                raise

    @property
    def urls(self) -> dict[str, str | None]:
        return {"ws": self.publisher.url, "http": None if self.http is None else self.http.url}

    def engine_gone(self, reason: str) -> None:
        """Every open HTTP response ends with a 503 and WebSocket clients are let go."""
        if self.http is not None:
            self.http.engine_gone(reason)
        self.publisher.stop()

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()
        self.publisher.stop()
        if self.trace is not None:
            self.trace.close()


class IdleCollector:
    """The cyclic garbage collector, run while the engine is quiet rather than mid-stream.

    Serving 256 streams keeps ~40k objects alive (each stream's coroutines, events, contexts),
    and an automatic full collection over them stopped the one serving loop for 7-16 ms (CPU,
    tiny model): every stream's next token late at once. Automatic collection is off; a full
    one runs once events have paused for `QUIET_S`, at most every `IDLE_EVERY_S`, and at least
    every `MAX_EVERY_S` under unbroken load (reference cycles wait that long to be freed;
    everything else is freed by reference counting as before)."""

    QUIET_S = 1.0
    IDLE_EVERY_S = 5.0
    MAX_EVERY_S = 30.0

    def __init__(self, last_event: Callable[[], float]) -> None:
        self.last_event = last_event
        self.last_collect = time.monotonic()
        self.collections = 0
        gc.disable()

    def tick(self) -> None:
        """From the main thread, every half second or so."""
        now = time.monotonic()
        since = now - self.last_collect
        quiet = now - self.last_event() >= self.QUIET_S
        if (quiet and since >= self.IDLE_EVERY_S) or since >= self.MAX_EVERY_S:
            gc.collect()
            self.last_collect = time.monotonic()
            self.collections += 1

    def close(self) -> None:
        gc.enable()


class _EarlyTokenizer:
    """The tokenizer of a model given as a local directory, loaded before the engine says
    which directory it reads (`facts.tokenizer`); used only if that is the same one."""

    def __init__(self, directory: Path | None) -> None:
        from engine.tokenizer import load_tokenizer_at

        self.directory = directory
        self.tokenizer = None if directory is None else load_tokenizer_at(directory)

    def take(self, directory: str) -> Any:
        from engine.tokenizer import load_tokenizer_at

        if self.directory is not None and Path(directory).resolve() == self.directory:
            return self.tokenizer
        return load_tokenizer_at(directory)


def _early_tokenizer(model: str) -> _EarlyTokenizer:
    path = Path(model).expanduser()
    try:
        if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
            return _EarlyTokenizer(path.resolve())
    except Exception:  # only a head start: the load after the engine's facts says what is wrong
        pass
    return _EarlyTokenizer(None)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # no line per connection
    # Until it serves, a signal ends it at once (nothing to close yet): an engine that failed to
    # start stops it in the middle of its imports instead of waiting for them.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    stop = threading.Event()
    settings = json.loads(sys.stdin.read())
    engine = EngineClient(settings["ipc"], parent_pid=settings["parent_pid"]).start()
    died: list[str] = []

    def gone(reason: str, clean: bool) -> None:
        if not clean:
            died.append(reason)
        stop.set()

    engine.on_gone = gone
    # While the engine loads its model: the imports, and the tokenizer if it can be told now
    # (the engine's facts confirm it). Each is on the way from the engine's ready to ours.
    import transformers  # noqa: F401

    if settings.get("http_port") is not None:
        from engine.server.openai import api, app  # noqa: F401
    early = _early_tokenizer(settings["model"])
    try:
        facts = engine.connect(stop)
    except EngineGone:
        facts = None
    if facts is None:
        return 0  # stopped before the engine was ready (it says why, if it failed)
    engine.tokenizer = early.take(facts.tokenizer)
    server = ApiServer(engine, settings)
    try:
        server.start()
    except OSError as exc:
        print(f"stepscope: cannot listen: {exc}", file=sys.stderr, flush=True)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):  # from now on, a signal stops it in order
        signal.signal(sig, lambda *_: stop.set())
    # as the engine process does (core.build): the imports, tokenizer and app (85k objects)
    # live for good; out of the collector's sight, a full collection while serving walks only
    # what serving made (the two at start-up took 29 and 45 ms each; every stream waits)
    gc.freeze()
    collector = IdleCollector(lambda: engine.last_event)
    engine.call_future("ready", **server.urls)
    while not stop.wait(0.5):
        collector.tick()
    collector.close()
    if died:
        grace = settings["engine_gone_grace"]
        log.error("%s: answering 503 for %g s, then exiting", died[0], grace)
        server.engine_gone(died[0])
        threading.Event().wait(grace)
    server.stop()
    engine.close()
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
