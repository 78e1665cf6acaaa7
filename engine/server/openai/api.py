"""The OpenAI-compatible HTTP API's engine side: requests in, tokens out, its lifecycle.

It runs in the API process (engine/server/frontend.py), beside the engine process it reaches through
an `EngineClient` (engine/server/client.py). A request over HTTP is an ordinary engine request,
submitted with `source="http"`: the page shows it like any other. Tokens come back the way they
reach every WebSocket client: the publisher hands each message of the engine's event stream to its
sinks on its own thread; `Router.sink` picks out the `token` and `request` messages of HTTP requests
and hands them to that request's `Stream` on the HTTP loop, where a `Generation` turns them into
text, usage and a finish reason.

The web app itself (Starlette under uvicorn, engine/server/openai/app.py) is made by the `app`
factory the composition root hands in, called only by `start()`: building a server with the API
on needs neither, so in-process benchmarks of `engine.server.build` run where they are not
installed. This module never imports the web app, which imports it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.detokenizer import StopMatcher
from engine.server.client import EngineClient, EngineGone
from engine.server.errors import ApiError
from engine.server.metrics.prometheus import EngineMetrics
from engine.server.openai.response import TokenLogprob, Usage
from instrumentation.publisher import running_on

if TYPE_CHECKING:  # the request models need pydantic, which only the web app imports
    from engine.server.openai.schema import GenerationRequest

log = logging.getLogger("stepscope.http")
Message = dict[str, Any]
# OpenAI's finish reasons, from the engine's: an EOS token is a natural stop
FINISH_REASONS = {"eos": "stop", "length": "length"}
CLOSED: Message = {"type": "_closed"}  # put on a stream when its client or the server goes away
GONE: Message = {"type": "_gone"}  # put on every stream when the engine process dies
STOP_TIMEOUT_S = 10
READ_TIMEOUT_S = 5.0  # a read waits for the engine's step to end: a 503 past this


@dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 2**20
    max_waiting: int = 1024
    model_names: tuple[str, ...] = ()  # besides the engine's own model name
    # /metrics needs this token when set; else it is open, as vLLM's --api-key guards only /v1
    metrics_token: str | None = None
    # sampling defaults from the model's generation_config.json (vLLM's --generation-config
    # auto); empty with `vllm`: OpenAI's defaults
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """`fn` on `loop` after the current callback: without a thread hop when the caller already
    runs there (the API process serves events and HTTP on one loop)."""
    if running_on(loop):
        loop.call_soon(fn)
        return
    with contextlib.suppress(RuntimeError):  # the HTTP loop has closed: shutting down
        loop.call_soon_threadsafe(fn)


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
            _call_soon(self._loop, self._wake)

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

    A submit's reply and the events come on two sockets (engine/server/ipc.py), so a new uid's first
    messages may arrive before the reply names it. While any submit awaits its reply (`expect`),
    messages of unknown uids are held, and `register` hands a uid the ones held for it; once no
    submit is outstanding, what is held belongs to other clients' requests and is dropped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._streams: dict[int, Stream] = {}
        self._dirty: list[Stream] = []  # streams given messages since the last wake-up
        self._wake_scheduled = False
        self._awaiting = 0  # submits sent and not yet answered
        self._held: dict[int, list[Message]] = {}

    def expect(self) -> None:
        """A submit is on its way: hold what comes for uids not known yet."""
        with self.lock:
            self._awaiting += 1

    def register(self, uids: list[int], stream: Stream) -> None:
        """The submit's reply named `uids` (HTTP loop): route them, and hand over what waited."""
        with self.lock:
            held = []
            for uid in uids:
                self._streams[uid] = stream
                held += self._held.pop(uid, ())
            self._settle()
        if held:
            stream._items.extend(held)
            stream._ready.set()

    def unexpect(self) -> None:
        """The submit failed: nothing to register."""
        with self.lock:
            self._settle()

    def _settle(self) -> None:
        self._awaiting -= 1
        if not self._awaiting:
            self._held.clear()

    def unregister(self, uid: int) -> None:
        with self.lock:
            self._streams.pop(uid, None)

    def sink(self, msg: Message, _text: str = "") -> None:
        """A publisher sink (publisher thread). One loop wake-up for every stream a burst of
        messages reaches (a step's tokens for 64 streams: one, not 64 cross-thread calls)."""
        if msg.get("type") not in ("token", "request"):
            return
        loop = None
        with self.lock:
            stream = self._streams.get(msg["uid"])
            if stream is None:
                if self._awaiting:
                    self._held.setdefault(msg["uid"], []).append(msg)
                return
            stream._items.append(msg)
            if not stream._wake_pending:
                stream._wake_pending = True
                self._dirty.append(stream)
                if not self._wake_scheduled:
                    self._wake_scheduled, loop = True, stream._loop
        if loop is not None:
            _call_soon(loop, self._wake_all)

    def _wake_all(self) -> None:
        """On the HTTP loop: wake every stream given messages since the last call."""
        with self.lock:
            dirty, self._dirty = self._dirty, []
            self._wake_scheduled = False
        for stream in dirty:
            stream._wake()

    def close_all(self, why: Message = CLOSED) -> None:
        with self.lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(why)


@dataclass(slots=True)
class Piece:
    """What one message adds to one choice: text (empty for a token that shows nothing yet:
    part of a character, or held back by a stop string) and the logprobs of its tokens."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Choice:
    """One engine request: one choice of a response (one of `n`, for one of its prompts)."""

    def __init__(self, index: int, uid: int, prompt_ids: list[int], echo: str | None,
                 req: GenerationRequest) -> None:  # fmt: skip
        self.index = index
        self.uid = uid
        self.prompt_ids = prompt_ids
        self.echo = echo  # the prompt's text, shown before the output (`echo`)
        self.want_logprobs = req.logprobs is not None
        self.matcher = StopMatcher(req.stop, req.include_stop_str)
        self.tokens = 0
        self.finish_reason: str | None = None
        self.error: ApiError | None = None
        self.done = False
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self._held: list[Piece] | None = [] if echo is not None else None  # until first_token

    def apply(self, msg: Message) -> list[Piece]:
        kind = msg["type"]
        if kind == "token":
            self.tokens += 1
            piece = Piece(self.index, self.matcher.push(msg["text"]))
            if self.want_logprobs:
                top = tuple((int(t), float(lp)) for t, lp in msg.get("top_logprobs", ()))
                piece.logprobs.append(TokenLogprob(msg["token_id"], msg["logprob"], top))
            if self.matcher.stopped:
                self._end("stop")
            return self._out([piece])
        event = msg["event"]
        if event == "first_token" and self._held is not None:
            assert self.echo is not None
            head = Piece(self.index, self.echo, self._prompt_logprobs(msg))
            held, self._held = self._held, None
            return self._out([head, *held])
        if event == "finished":
            self._end(FINISH_REASONS.get(msg.get("finish_reason"), "stop"))
            return self._out([Piece(self.index, tail)] if (tail := self.matcher.flush()) else [])
        if event == "aborted":  # by someone else: a WebSocket client, say
            self._end("abort")
        elif event == "rejected":
            self.error = ApiError(400, str(msg.get("message", "the engine rejected the request")))
            self._end(None)
        return []

    def _prompt_logprobs(self, msg: Message) -> list[TokenLogprob]:
        if not self.want_logprobs:
            return []
        rows = msg.get("prompt_logprobs", [])
        out = [TokenLogprob(self.prompt_ids[0], None)]
        for tid, (lp, top) in zip(self.prompt_ids[1:], rows, strict=True):
            out.append(TokenLogprob(tid, lp, tuple((int(t), float(v)) for t, v in top)))
        return out

    def _out(self, pieces: list[Piece]) -> list[Piece]:
        if self._held is not None:  # echo: the prompt comes first
            self._held += pieces
            return []
        for p in pieces:
            self.text.append(p.text)
            self.logprobs += p.logprobs
        return pieces

    def _end(self, reason: str | None) -> None:
        self.done = True
        self.finish_reason = reason


class Generation:
    """Follows the engine requests of one API request (n choices per prompt) on one stream."""

    def __init__(self, api: HttpApi, stream: Stream, choices: list[Choice], prompt_tokens: int):
        self.api = api
        self.stream = stream
        self.choices = choices
        self._by_uid = {c.uid: c for c in choices}
        self.usage = Usage(prompt_tokens=prompt_tokens)
        self.error: ApiError | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(c.done for c in self.choices)

    async def batches(self) -> AsyncIterator[list[Piece]]:
        """Pieces as they arrive: one per token, even a token that shows no text yet, so a
        client that times chunks times tokens, as with vLLM; plus held-back tails at the end."""
        while not self.done:
            pieces: list[Piece] = []
            for msg in await self.stream.get():
                if msg["type"] == "_closed":
                    self.close()
                    break
                if msg["type"] == "_gone":
                    self.error = engine_gone(self.api.gone)
                    break
                choice = self._by_uid.get(msg["uid"])
                if choice is None or choice.done:
                    continue  # a token of a choice already ended on a stop string
                pieces += choice.apply(msg)
                if msg["type"] == "token":
                    self.usage.completion_tokens += 1
                if choice.done:
                    self._ended(choice)
                if self.done:
                    break
            if pieces:
                yield pieces

    @property
    def finish_reason(self) -> str | None:
        """The first choice's (a one-choice request's: its own)."""
        return self.choices[0].finish_reason

    async def text_batches(self) -> AsyncIterator[list[str]]:
        """`batches` as the text of each piece, for callers that want text only."""
        async for pieces in self.batches():
            yield [p.text for p in pieces]

    def _ended(self, choice: Choice) -> None:
        self.api.router.unregister(choice.uid)
        if choice.finish_reason == "stop" and choice.matcher.stopped:
            self.api.stop_request(choice.uid)  # the engine would go on: end it there too
        if choice.error is not None:
            self.error = choice.error
            self.close()

    def close(self) -> None:
        """The client went away (or the response ended): abort every choice still generating."""
        for choice in self.choices:
            if not choice.done:
                choice._end("abort")
                self.api.router.unregister(choice.uid)
                self.api.abort(choice.uid)


def engine_gone(reason: str | None) -> ApiError:
    return ApiError(503, f"the engine is not running ({reason or 'gone'}); try later",
                    type="service_unavailable", code="engine_gone")  # fmt: skip


class HttpApi:
    """Build with the engine's client and the metrics; `start()` binds and serves, `stop()`
    ends it."""

    def __init__(
        self,
        engine: EngineClient,
        config: HttpConfig,
        metrics: EngineMetrics,
        app: Callable[[HttpApi], Any],
    ) -> None:
        self.engine = engine
        self.app = app  # the ASGI app's factory (openai.app.build_app), called by start()
        self.config = config
        self.metrics = metrics
        self.router = Router()
        self.sinks = [metrics, self.router.sink]  # for the publisher
        self.gone: str | None = None  # why the engine process is gone (then every request gets 503)
        self.model = engine.info.model
        self.model_names = frozenset((self.model, *config.model_names))
        self.port = config.port
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._served: concurrent.futures.Future | None = None  # serving on a shared loop
        self._tokens: dict[int, str] = {}  # token id → its text alone (logprobs)

    def token_text(self, token_id: int) -> str:
        """A token's text decoded alone, as vLLM writes logprobs' tokens (HTTP thread)."""
        text = self._tokens.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._tokens) < 1 << 20:
                self._tokens[token_id] = text
        return text

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Bind (raising OSError, e.g. port in use) and serve in a daemon thread, or on `loop`
        (another thread's running loop) when given."""
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
        if loop is not None:
            self._served = asyncio.run_coroutine_threadsafe(self._server.serve([sock]), loop)
            alive: Callable[[], bool] = lambda: not self._served.done()  # noqa: E731
        else:
            self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                            name="stepscope-http", daemon=True)  # fmt: skip
            self._thread.start()
            alive = self._thread.is_alive
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        """End every open stream, then the server; safe to call more than once."""
        self.router.close_all()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)
        if self._served is not None:
            with contextlib.suppress(Exception):  # a failure was logged; a timeout: give up
                self._served.result(timeout=STOP_TIMEOUT_S)

    def engine_gone(self, reason: str) -> None:
        """The engine process died: every open response ends with a 503, and so does every
        later request."""
        self.gone = reason
        self.router.close_all(GONE)

    # -- engine calls -------------------------------------------------------------------
    async def submit(
        self, requests: list[tuple[list[int], Any]], stream: Stream, source: str
    ) -> list[int]:
        """Queue the requests in the engine, all or none; their messages go to `stream`.
        The engine's refusal (capacity, size) is raised as its EngineError."""
        if self.gone is not None:
            raise engine_gone(self.gone)
        self.router.expect()
        try:
            uids = await self.engine.call("submit", requests=requests, source=source)
        except BaseException as exc:
            self.router.unexpect()
            if isinstance(exc, EngineGone):
                raise engine_gone(str(exc)) from None
            raise
        self.router.register(uids, stream)
        return uids

    async def read(self, name: str, timeout: float = READ_TIMEOUT_S) -> Any:
        """One of the engine's reads between steps (engine.server.bridge.READS); a 503 if it
        cannot answer."""
        try:
            return await self.engine.call("read", name=name, timeout=timeout)
        except TimeoutError:
            raise ApiError(
                503, "the engine did not answer in time", type="service_unavailable"
            ) from None
        except EngineGone as exc:
            raise engine_gone(str(exc)) from None

    def abort(self, uid: int) -> None:
        """Nobody waits for the answer: a request that ended meanwhile is not an error."""
        self.engine.send("abort", uid=uid)

    def stop_request(self, uid: int) -> None:
        """A stop string matched: end the request, counted as a `stop` in the metrics."""
        self.metrics.mark_stop(uid)
        self.abort(uid)


# generation_config.json keys that set sampling defaults, as vLLM reads them
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "max_new_tokens": "max_tokens"}  # fmt: skip


def generation_defaults(model_dir: Path | None) -> dict[str, Any]:
    """The sampling defaults a model's generation_config.json sets (vLLM's `auto`): request
    fields left out take them. Keys this engine cannot apply are named in a warning."""
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    out = {GENERATION_KEYS[k]: v for k, v in raw.items() if k in GENERATION_KEYS and v is not None}
    if (rep := raw.get("repetition_penalty")) not in (None, 1, 1.0):
        log.warning("generation_config.json's repetition_penalty=%s is not applied: this "
                    "engine has no penalties", rep)  # fmt: skip
    return out


def build_http_api(
    engine: EngineClient,
    *,
    host: str,
    port: int,
    token: str | None,
    allowed_origins: tuple[str, ...],
    max_waiting: int,
    model_arg: str,
    app: Callable[[HttpApi], Any],
    metrics_token: str | None = None,
    generation_config: str = "auto",
    metrics_compat: str | None = None,
    delays: bool = True,
) -> HttpApi:
    """The API for `python -m engine.server`: `model_arg` (the --model given) is accepted as a
    model name besides the engine's own. `generation_config`: `auto` applies the model's
    generation_config.json sampling defaults, `vllm` ignores them (vLLM's switch)."""
    import prometheus_client

    # as vLLM does: no `_created` series beside every counter and histogram (process-wide)
    prometheus_client.disable_created_metrics()
    names = (model_arg, model_arg.rstrip("/").rsplit("/", 1)[-1])
    defaults = {}
    model_dir = engine.facts.model_dir if engine.facts is not None else None
    if generation_config == "auto" and model_dir:
        with contextlib.suppress(Exception):  # a dummy or odd model has no file to read
            defaults = generation_defaults(Path(model_dir))
    if defaults:
        log.info("sampling defaults from generation_config.json: %s", defaults)
    config = HttpConfig(host=host, port=port, token=token, allowed_origins=allowed_origins,
                        max_waiting=max_waiting, model_names=names, metrics_token=metrics_token,
                        sampling_defaults=defaults)  # fmt: skip
    metrics = EngineMetrics(engine.info.model, metrics_compat, engine.info.max_seq_len, delays)
    return HttpApi(engine, config, metrics, app)
