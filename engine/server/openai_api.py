"""The OpenAI-compatible HTTP API's engine side: requests in, tokens out, its lifecycle.

A request over HTTP is an ordinary engine request, submitted with `source="http"`: the page
shows it like any other. Tokens come back the way they reach every WebSocket client: the
publisher hands each serialized message to its sinks on its own thread; `Router.sink` picks out
the `token` and `request` messages of HTTP requests and hands them to that request's `Stream` on
the HTTP loop, where a `Generation` turns them into text, usage and a finish reason.

The web app itself (Starlette under uvicorn, engine/server/openai_app.py) is made by the `app`
factory the composition root hands in, called only by `start()`: building a server with the API
on needs neither, so in-process benchmarks of `engine.server.build` run where they are not
installed. This module never imports the web app, which imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.server.openai_schema import (
    FINISH_REASONS,
    ApiError,
    GenerationRequest,
    StopMatcher,
    Usage,
)
from engine.server.prometheus import EngineMetrics
from instrumentation.errors import NotFound

Message = dict[str, Any]
CLOSED: Message = {"type": "_closed"}  # put on a stream when its client or the server goes away
STOP_TIMEOUT_S = 10


@dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 2**20
    max_waiting: int = 1024
    model_names: tuple[str, ...] = ()  # besides the engine's own model name


class Stream:
    """One request's messages, put by the publisher thread and read on the HTTP loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Message] = deque()
        self._ready = asyncio.Event()
        self._wake_pending = False

    def put(self, msg: Message) -> None:
        """Any thread. One loop wake-up per burst, not per token."""
        self._items.append(msg)
        if not self._wake_pending:
            self._wake_pending = True
            with contextlib.suppress(RuntimeError):  # the HTTP loop has closed: shutting down
                self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._wake_pending = False
        self._ready.set()

    async def get(self) -> list[Message]:
        """Everything that arrived since the last call; waits while there is nothing."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        out = list(self._items)
        for _ in out:
            self._items.popleft()
        return out


class Router:
    """Routes `token` and `request` messages of HTTP requests to their streams.

    `lock` is held across submit-and-register, so no message of a new uid can be routed before
    its stream is registered (the engine may publish its `queued` event at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._streams: dict[int, Stream] = {}

    def register(self, uid: int, stream: Stream) -> None:
        self._streams[uid] = stream  # the caller holds `lock`

    def unregister(self, uid: int) -> None:
        with self.lock:
            self._streams.pop(uid, None)

    def sink(self, msg: Message, _text: str = "") -> None:
        """A publisher sink (publisher thread)."""
        if msg.get("type") not in ("token", "request"):
            return
        with self.lock:
            stream = self._streams.get(msg["uid"])
        if stream is not None:
            stream.put(msg)

    def close_all(self) -> None:
        with self.lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(CLOSED)


class Generation:
    """Follows one submitted request: text safe to show, usage, finish reason or error."""

    def __init__(self, api: HttpApi, uid: int, stream: Stream, req: GenerationRequest, n: int):
        self.api = api
        self.uid = uid
        self.stream = stream
        self.usage = Usage(prompt_tokens=n)
        self.matcher = StopMatcher(req.stop)
        self.finish_reason: str | None = None
        self.error: ApiError | None = None
        self.done = False

    async def batches(self) -> AsyncIterator[list[str]]:
        """Lists of text pieces as they arrive: one per token, even a token that shows no text
        yet (part of a character, or held back by a stop string), so a client that times
        chunks times tokens, as with vLLM; plus the held-back tail at the end."""
        while not self.done:
            pieces = []
            for msg in await self.stream.get():
                piece = self._apply(msg)
                if piece is not None:
                    pieces.append(piece)
                if self.done:
                    break
            if pieces:
                yield pieces

    def _apply(self, msg: Message) -> str | None:
        kind = msg["type"]
        if kind == "token":
            self.usage.completion_tokens += 1
            piece = self.matcher.push(msg["text"])
            if self.matcher.stopped:
                self._end("stop")
                self.api.stop_request(self.uid)
            return piece
        if kind == "_closed":
            self._end("abort")
            return None
        event = msg["event"]
        if event == "finished":
            self._end(FINISH_REASONS.get(msg.get("finish_reason"), "stop"))
            return self.matcher.flush() or None
        if event == "aborted":  # by someone else: a WebSocket client, say
            self._end("abort")
        elif event == "rejected":
            self.error = ApiError(400, str(msg.get("message", "the engine rejected the request")))
            self._end(None)
        return None

    def _end(self, reason: str | None) -> None:
        self.done = True
        self.finish_reason = reason
        self.api.router.unregister(self.uid)

    def close(self) -> None:
        """The client went away (or the response failed): abort if still generating."""
        if not self.done:
            self._end("abort")
            self.api.abort(self.uid)


class HttpApi:
    """Build with the engine and its metrics; `start()` binds and serves, `stop()` ends it."""

    def __init__(
        self,
        llm: Any,
        config: HttpConfig,
        metrics: EngineMetrics,
        app: Callable[[HttpApi], Any],
    ) -> None:
        self.llm = llm
        self.app = app  # the ASGI app's factory (openai_app.build_app), called by start()
        self.config = config
        self.metrics = metrics
        self.router = Router()
        self.sinks = [metrics, self.router.sink]  # for the publisher
        # set by the server once the engine loop exists: wake it after submit/abort, and run a
        # read on the engine thread between steps (the live KV gauge)
        self.wake: Callable[[], None] = lambda: None
        self.call: Callable[[Callable[[], Any]], Future] | None = None
        self.model = llm.info.model
        self.model_names = frozenset((self.model, *config.model_names))
        self.port = config.port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Bind (raising OSError, e.g. port in use) and serve in a daemon thread."""
        import uvicorn

        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.config.host.strip("[]"), self.config.port))
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app(self), lifespan="off", log_level="warning", access_log=False,
            timeout_graceful_shutdown=2, loop="asyncio",
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="stepscope-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        """End every open stream, then the server; safe to call more than once."""
        self.router.close_all()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)

    # -- engine calls -------------------------------------------------------------------
    def abort(self, uid: int) -> None:
        with contextlib.suppress(NotFound):  # it ended on its own meanwhile
            self.llm.abort(uid)
        self.wake()

    def stop_request(self, uid: int) -> None:
        """A stop string matched: end the request, counted as a `stop` in the metrics."""
        self.metrics.mark_stop(uid)
        self.abort(uid)


def build_http_api(
    llm: Any,
    *,
    host: str,
    port: int,
    token: str | None,
    allowed_origins: tuple[str, ...],
    max_waiting: int,
    model_arg: str,
    app: Callable[[HttpApi], Any],
) -> HttpApi:
    """The API for `python -m engine.server`: `model_arg` (the --model given) is accepted as a
    model name besides the engine's own."""
    import prometheus_client

    # as vLLM does: no `_created` series beside every counter and histogram (process-wide)
    prometheus_client.disable_created_metrics()
    names = (model_arg, model_arg.rstrip("/").rsplit("/", 1)[-1])
    config = HttpConfig(host=host, port=port, token=token, allowed_origins=allowed_origins,
                        max_waiting=max_waiting, model_names=names)  # fmt: skip
    return HttpApi(llm, config, EngineMetrics(llm.info.model), app)
