"""The OpenAI-compatible web app: Starlette endpoints over an `HttpApi` (api.py).

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

from engine.server.client import EngineGone
from engine.server.openai.api import (
    CLOSED,
    Choice,
    Generation,
    HttpConfig,
    Piece,
    Stream,
    engine_gone,
)
from engine.server.openai.response import (
    ChoiceOut,
    ResponseHead,
    chat_logprobs,
    completion_logprobs,
)
from engine.server.openai.schema import (
    COMPLETIONS_MAX_TOKENS,
    ApiError,
    Endpoint,
    GenerationRequest,
    bad,
    parse_request,
)
from engine.server.sglang.worker import SglangWorker
from instrumentation.errors import Capacity, EngineError, NotFound, TooLarge
from instrumentation.publisher import origin_allowed
from instrumentation.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.server.openai.api import HttpApi

log = logging.getLogger("stepscope.http")

Message = dict[str, Any]


def build_app(api: HttpApi) -> ASGIApp:
    routes = Endpoints(api).app()
    app: ASGIApp = _Guard(routes, api.config)
    if api.metrics.compat == "vllm":  # vLLM's http_requests_total and durations
        from engine.server.metrics.vllm import HttpStats

        paths = frozenset(getattr(r, "path", "") for r in routes.routes)
        api.metrics.http = HttpStats(paths)
        app = _Timed(app, api.metrics.http)
    return app


class _Timed:
    """Outermost ASGI layer under --metrics-compat vllm: each HTTP request's route, method,
    status and time to the end of its response, for vLLM's http_* metrics."""

    def __init__(self, app: ASGIApp, stats: Any) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.stats.observe(scope["path"], scope["method"], status, time.perf_counter() - t0)


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
    if isinstance(exc, Capacity):
        return ApiError(429, str(exc), type="rate_limit_error", code="capacity")
    if isinstance(exc, NotFound):
        return ApiError(404, str(exc), code="not_found")
    return bad(str(exc))


class Endpoints:
    """The request handlers, over the engine glue of `api`."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.engine = api.engine
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
                except EngineGone as exc:
                    return _error(engine_gone(str(exc)))

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
        if self.api.gone is not None:
            return _error(engine_gone(self.api.gone))
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        card = {
            "id": self.api.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "stepscope",
            "root": self.api.model,
            "max_model_len": self.engine.info.max_seq_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def _metrics(self, request: Request) -> Response:
        with contextlib.suppress(Exception):  # a live reading: steps report the pool only
            kv = await self.api.read("kv_stats", timeout=2)  # while they run
            self.metrics.set_kv(kv.used, kv.total)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    def parse(self, obj: Any, endpoint: Endpoint) -> GenerationRequest:
        return parse_request(obj, endpoint)

    def event_stream(self, body: AsyncIterator[bytes], gen: Generation) -> Response:
        return EventStreamResponse(body, gen)  # type: ignore[return-value]

    async def read_json(self, request: Request) -> Any:
        """The body as JSON (jiter's parser: a lone surrogate is invalid, as on /v1)."""
        from pydantic_core import from_json

        try:
            return from_json(await self._read_body(request))
        except ValueError as exc:
            raise bad(f"the body is not valid JSON: {str(exc)[:120]}") from None

    async def start(
        self, req: GenerationRequest, source: str = "http"
    ) -> tuple[Generation, ResponseHead]:
        """Check the model and the queue, tokenize, submit: the request's Generation."""
        if req.model is not None and req.model not in self.api.model_names:
            raise ApiError(
                404, f"The model `{req.model}` does not exist.", code="model_not_found",
                param="model",
            )  # fmt: skip
        # off the HTTP loop: tokenizing a long prompt must not hold up other clients
        prompts = await asyncio.to_thread(self._encode, req)
        gen = await self._submit(req, prompts, Stream(asyncio.get_running_loop()), source)
        prefix = "cmpl" if req.endpoint == "completion" else "chatcmpl"
        uid = gen.choices[0].uid
        head = ResponseHead(f"{prefix}-{uid}-{secrets.token_hex(6)}", self.api.model, req.endpoint)
        return gen, head

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        req = parse_request(await self._read_body(request), endpoint)
        gen, head = await self.start(req)
        if req.stream:
            return EventStreamResponse(self._events(gen, head, req), gen)  # type: ignore[return-value]
        watcher = asyncio.create_task(_watch_disconnect(request.receive, gen))
        try:
            async for _ in gen.batches():
                pass  # each choice keeps its text and logprobs
        finally:
            watcher.cancel()
            gen.close()  # whatever ended the wait, no request may go on without a reader
        if gen.error is not None:
            raise gen.error
        choices = [
            ChoiceOut(c.index, "".join(c.text), c.finish_reason, self._logprobs(req, c.logprobs))
            for c in gen.choices
        ]
        return JSONResponse(head.response(choices, gen.usage))

    async def _submit(
        self,
        req: GenerationRequest,
        prompts: list[tuple[list[int], str]],
        stream: Stream,
        source: str,
    ) -> Generation:
        """Submit n engine requests per prompt, all routed to `stream`; all or none (the engine
        checks its queue's capacity and every size before it queues any)."""
        params = [self._params(req, ids, j) for ids, _ in prompts for j in range(req.n)]
        for (ids, _), p in zip(prompts, params[:: req.n], strict=True):
            self.engine.check_fits(len(ids), p.max_tokens)  # a clear error before any call
        requests = [(prompts[k // req.n][0], p) for k, p in enumerate(params)]
        uids = await self.api.submit(requests, stream, source)
        choices = [
            Choice(k, uid, prompts[k // req.n][0], prompts[k // req.n][1] if req.echo else None,
                   req)
            for k, uid in enumerate(uids)
        ]  # fmt: skip
        return Generation(self.api, stream, choices, sum(len(ids) for ids, _ in prompts))

    def _params(self, req: GenerationRequest, ids: list[int], j: int) -> SamplingParams:
        """Sampling for choice j of a prompt: the request's fields, else the model's
        generation_config.json defaults, else OpenAI's; seeds seed, seed + 1, ... as vLLM's."""
        d = self.config.sampling_defaults
        room = self._room(len(ids))
        max_tokens = req.max_tokens
        if max_tokens is None:
            default = COMPLETIONS_MAX_TOKENS if req.endpoint == "completion" else room
            max_tokens = min(default, d.get("max_tokens", default))
        top_k = req.top_k if req.top_k is not None else int(d.get("top_k", -1))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_pick(req.temperature, d, "temperature", 1.0)),
            top_p=float(_pick(req.top_p, d, "top_p", 1.0)),
            top_k=-1 if top_k == 0 else top_k,
            min_p=float(_pick(req.min_p, d, "min_p", 0.0)),
            ignore_eos=req.ignore_eos,
            seed=None if req.seed is None else (req.seed + j) % 2**64,
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo else None,
            skip_special_tokens=req.skip_special_tokens,
        )

    def _logprobs(self, req: GenerationRequest, entries: list, offset: int = 0) -> Message | None:
        if req.logprobs is None:
            return None
        decode = _token_id_text if req.tokens_as_ids else self.api.token_text
        if req.endpoint == "chat":
            return chat_logprobs(entries, decode)
        return completion_logprobs(entries, decode, offset)

    async def _events(
        self, gen: Generation, head: ResponseHead, req: GenerationRequest
    ) -> AsyncIterator[bytes]:
        continuous = req.include_usage and req.continuous_usage
        offsets = [0] * len(gen.choices)  # completions' text_offset, per choice

        def chunk(piece: Piece, reason: str | None = None, role: bool = False) -> bytes:
            if not (piece.logprobs or reason or role or continuous):
                return head.text_chunk(piece.index, piece.text)  # the hot path
            logprobs = None
            if piece.logprobs:
                logprobs = self._logprobs(req, piece.logprobs, offsets[piece.index])
                offsets[piece.index] += len(piece.text)
            obj = head.chunk(piece.index, piece.text, reason, role=role, logprobs=logprobs)
            if continuous:
                obj["usage"] = gen.usage.to_dict()
            return _sse(obj)

        if req.endpoint == "chat":
            yield b"".join(chunk(Piece(c.index, ""), role=True) for c in gen.choices)
        async for pieces in gen.batches():
            yield b"".join(chunk(p) for p in pieces)
        if gen.error is not None:
            yield _sse(gen.error.body())
        else:
            yield b"".join(chunk(Piece(c.index, ""), c.finish_reason or "abort")
                           for c in gen.choices)  # fmt: skip
            if req.include_usage:
                yield _sse(head.usage_chunk(gen.usage))
        yield b"data: [DONE]\n\n"

    async def _read_body(self, request: Request) -> bytes:
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
        return bytes(body)

    def _encode(self, req: GenerationRequest) -> list[tuple[list[int], str]]:
        """Each prompt's token ids and text (a worker thread); InvalidRequest on a bad one."""
        if req.endpoint == "completion":
            out = []
            for prompt in req.prompts:
                ids = self.engine.encode(prompt)
                text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)
                out.append((ids, text))
            return out
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad("this model has no chat template; use /v1/completions", param="messages")
        try:
            # as LLM.encode(chat=True) does for one user message, for a whole conversation;
            # chat_template_kwargs (Qwen3's enable_thinking, say) reach the template
            kwargs = {**req.chat_template_kwargs, "tokenize": False,
                      "add_generation_prompt": req.add_generation_prompt}  # fmt: skip
            text = tok.apply_chat_template(list(req.messages), **kwargs)
        except Exception as exc:  # the template's own checks (roles must alternate, ...)
            raise bad(f"the chat template refused these messages: {exc}", "messages") from None
        ids = list(tok.encode(text, add_special_tokens=False))
        if not ids:
            raise bad("the conversation is empty", param="messages")
        return [(ids, text)]

    def _room(self, prompt_len: int) -> int:
        """The default max_tokens on chat (as vLLM's): whatever the context and the pool leave."""
        info = self.engine.info
        return max(1, min(info.max_seq_len, info.num_pages * info.page_size) - prompt_len)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"  # vLLM's return_tokens_as_token_ids


def _pick(value: Any, defaults: dict[str, Any], name: str, fallback: Any) -> Any:
    return value if value is not None else defaults.get(name, fallback)


class _Guard:
    """Outermost ASGI layer: the WebSocket's rules (a Bearer token when one is set, browser
    origins limited to localhost and --allow-origin) for every path except /health. /metrics
    takes its own token (--metrics-token) and is open without one, as vLLM's --api-key guards
    only /v1: a Prometheus scraper need not hold the key that can generate."""

    def __init__(self, app: ASGIApp, config: HttpConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            token = self.config.metrics_token if scope["path"] == "/metrics" else self.config.token
            denied = self._deny(headers, token)
            if denied is not None:
                await denied(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _deny(self, headers: dict[str, str], token: str | None) -> Response | None:
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
