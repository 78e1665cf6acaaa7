"""The OpenAI-compatible web app: Starlette endpoints over an `HttpApi` (openai_api.py).

`POST /v1/completions` and `POST /v1/chat/completions` (streamed through server-sent events or
not), `GET /v1/models`, `GET /health` and `GET /metrics` (Prometheus). Errors are OpenAI's shape
with a 4xx status for anything the client sent; a client that goes away aborts its request at
once (a watcher sees the disconnect even while no token is due). The WebSocket's safety rules
apply: a Bearer token when the server has one, browser origins limited to localhost and
--allow-origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.openai_api import CLOSED, Generation, HttpConfig, Stream
from engine.server.openai_schema import (
    ApiError,
    Endpoint,
    GenerationRequest,
    ResponseHead,
    bad,
    parse_request,
)
from engine.server.sglang_api import SglangWorker
from instrumentation.errors import EngineError, NotFound, TooLarge
from instrumentation.publisher import origin_allowed
from instrumentation.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.server.openai_api import HttpApi

log = logging.getLogger("stepscope.http")

Message = dict[str, Any]


def build_app(api: HttpApi) -> ASGIApp:
    return _Guard(Endpoints(api).app(), api.config)


class EventStreamResponse:
    """Server-sent events that abort their request the moment the client disconnects."""

    def __init__(self, body: AsyncIterator[bytes], gen: Generation) -> None:
        self.body = body
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        watcher = asyncio.create_task(_watch_disconnect(receive, self.gen))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            pass
        finally:
            watcher.cancel()
            self.gen.close()


async def _watch_disconnect(receive: Receive, gen: Generation) -> None:
    """Abort the request as soon as its client disconnects, even while no token is due."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gen.close()
    gen.stream.put(CLOSED)  # wake the writer, which may be waiting for tokens


def _sse(obj: Message) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _engine_error(exc: EngineError) -> ApiError:
    if isinstance(exc, TooLarge):
        return bad(str(exc), code="context_length_exceeded")
    if isinstance(exc, NotFound):
        return ApiError(404, str(exc), code="not_found")
    return bad(str(exc))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class Endpoints:
    """The request handlers, over the engine glue of `api`."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.llm = api.llm
        self.config = api.config
        self.metrics = api.metrics
        self.router = api.router

    def app(self) -> Starlette:
        def endpoint(fn: Callable[[Request], Awaitable[Response]]) -> Callable:
            async def run(request: Request) -> Response:
                try:
                    return await fn(request)
                except ApiError as exc:
                    return _error(exc)
                except EngineError as exc:
                    return _error(_engine_error(exc))

            return run

        async def completions(request: Request) -> Response:
            return await self._generate(request, "completion")

        async def chat(request: Request) -> Response:
            return await self._generate(request, "chat")

        routes = [
            Route("/health", endpoint(self._health), methods=["GET"]),
            Route("/v1/models", endpoint(self._models), methods=["GET"]),
            Route("/metrics", endpoint(self._metrics), methods=["GET"]),
            Route("/v1/completions", endpoint(completions), methods=["POST"]),
            Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
            *SglangWorker(self).routes(endpoint),  # what SGLang's Model Gateway calls
        ]
        return Starlette(
            routes=routes,
            exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        )

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        card = {
            "id": self.api.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "stepscope",
            "root": self.api.model,
            "max_model_len": self.llm.info.max_seq_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def _metrics(self, request: Request) -> Response:
        if self.api.call is not None:  # a live reading: steps report the pool only while they run
            with contextlib.suppress(Exception):
                kv = await asyncio.wait_for(
                    asyncio.wrap_future(self.api.call(self.llm.kv_stats)), 2
                )
                self.metrics.set_kv(kv.used, kv.total)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    def parse(self, obj: Any, endpoint: Endpoint) -> GenerationRequest:
        return parse_request(obj, endpoint)

    def event_stream(self, body: AsyncIterator[bytes], gen: Generation) -> Response:
        return EventStreamResponse(body, gen)  # type: ignore[return-value]

    async def start(
        self, req: GenerationRequest, source: str = "http"
    ) -> tuple[Generation, ResponseHead]:
        """Check the model and the queue, tokenize, submit: the request's Generation."""
        if req.model is not None and req.model not in self.api.model_names:
            raise ApiError(
                404, f"The model `{req.model}` does not exist.", code="model_not_found",
                param="model",
            )  # fmt: skip
        if self.llm.num_waiting() >= self.config.max_waiting:
            raise ApiError(
                429, f"{self.config.max_waiting} requests are already waiting; try later",
                type="rate_limit_error", code="capacity",
            )  # fmt: skip
        # off the HTTP loop: tokenizing a long prompt must not hold up other clients
        ids = await asyncio.to_thread(self._encode, req)
        params = SamplingParams(
            max_tokens=req.max_tokens or self._room(len(ids)),
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            ignore_eos=req.ignore_eos, seed=req.seed,
        )  # fmt: skip
        stream = Stream(asyncio.get_running_loop())
        with self.router.lock:
            uid = self.llm.submit(ids, params, source=source)
            self.router.register(uid, stream)
        self.api.wake()
        gen = Generation(self.api, uid, stream, req, len(ids))
        prefix = "cmpl" if req.endpoint == "completion" else "chatcmpl"
        head = ResponseHead(f"{prefix}-{uid}-{secrets.token_hex(6)}", self.api.model, req.endpoint)
        return gen, head

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        req = parse_request(await self.read_json(request), endpoint)
        gen, head = await self.start(req)
        if req.stream:
            return EventStreamResponse(self._events(gen, head, req), gen)  # type: ignore[return-value]
        watcher = asyncio.create_task(_watch_disconnect(request.receive, gen))
        try:
            text = "".join([p async for batch in gen.batches() for p in batch])
        finally:
            watcher.cancel()
            gen.close()  # whatever ended the wait, the request must not go on without a reader
        if gen.error is not None:
            raise gen.error
        return JSONResponse(head.response(text, gen.finish_reason, gen.usage))

    async def _events(
        self, gen: Generation, head: ResponseHead, req: GenerationRequest
    ) -> AsyncIterator[bytes]:
        continuous = req.include_usage and req.continuous_usage

        def chunk(text: str, reason: str | None = None, role: bool = False) -> bytes:
            obj = head.chunk(text, reason, role=role)
            if continuous:
                obj["usage"] = gen.usage.to_dict()
            return _sse(obj)

        if req.endpoint == "chat":
            yield chunk("", role=True)
        async for pieces in gen.batches():
            yield b"".join(chunk(p) for p in pieces)
        if gen.error is not None:
            yield _sse(gen.error.body())
        else:
            yield chunk("", gen.finish_reason or "abort")
            if req.include_usage:
                yield _sse(head.usage_chunk(gen.usage))
        yield b"data: [DONE]\n\n"

    async def read_json(self, request: Request) -> Any:
        limit = self.config.max_body_bytes
        too_big = ApiError(413, f"the request body is over {limit} bytes", code="too_large")
        # read an oversized body to its end (up to a bound) before answering: a client still
        # sending when the connection closes would see a reset instead of the 413
        body, seen = bytearray(), 0
        async for part in request.stream():
            seen += len(part)
            if seen <= limit:
                body += part
            elif seen > 16 * limit:
                break
        if seen > limit:
            raise too_big
        try:
            return json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise bad(f"the body is not valid JSON: {str(exc)[:120]}") from None

    def _encode(self, req: GenerationRequest) -> list[int]:
        """Token ids for the request (a worker thread); InvalidRequest on a bad prompt."""
        if req.endpoint == "completion":
            assert req.prompt is not None
            return self.llm.encode(req.prompt)
        tok = self.llm.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad("this model has no chat template; use /v1/completions", param="messages")
        try:
            # as LLM.encode(chat=True) does for one user message, for a whole conversation
            text = tok.apply_chat_template(
                list(req.messages), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template's own checks (roles must alternate, ...)
            raise bad(f"the chat template refused these messages: {exc}", "messages") from None
        ids = list(tok.encode(text, add_special_tokens=False))
        if not ids:
            raise bad("the conversation is empty", param="messages")
        return ids

    def _room(self, prompt_len: int) -> int:
        """The default max_tokens (as vLLM's): whatever the context and the pool leave."""
        info = self.llm.info
        return max(1, min(info.max_seq_len, info.num_pages * info.page_size) - prompt_len)


class _Guard:
    """Outermost ASGI layer: the WebSocket's rules (a Bearer token when one is set, browser
    origins limited to localhost and --allow-origin) for every path except /health."""

    def __init__(self, app: ASGIApp, config: HttpConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            denied = self._deny(headers)
            if denied is not None:
                await denied(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _deny(self, headers: dict[str, str]) -> Response | None:
        token = self.config.token
        if token is not None:
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), token.encode()):
                exc = ApiError(401, "a valid Bearer token is required", type="authentication_error",
                               code="invalid_api_key")  # fmt: skip
                return JSONResponse(
                    exc.body(), 401, headers={"WWW-Authenticate": 'Bearer realm="stepscope"'}
                )
        if not origin_allowed(headers.get("origin"), self.config.allowed_origins):
            return _error(ApiError(403, "origin not allowed", type="permission_error"))
        return None


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "error")
    return _error(ApiError(exc.status_code, str(exc.detail), type=kind))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("HTTP handler failed", exc_info=exc)
    return _error(ApiError(500, "internal error", type="internal_error"))
