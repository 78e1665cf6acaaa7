"""SGLang's worker API, so that SGLang's Model Gateway (`sglang-router --backend sglang`) can put
stepscope replicas behind it as it puts SGLang servers.

What the gateway (0.3.2) calls on a worker, found by running it against a logging stub:
- at registration: `GET /health`, `GET /server_info` (falls back to `/get_server_info`; reads
  `dp_size`), `GET /model_info` (falls back to `/get_model_info`);
- every health-check interval: `GET /health`;
- under `power_of_two`, its load monitor: `GET /get_load` (it reads `num_tokens`);
- requests: `POST /v1/completions`, `/v1/chat/completions` (the OpenAI API) and SGLang's native
  `POST /generate`; `POST /flush_cache` on an operator's call.

The load is the real one: running and waiting requests and the KV tokens in use, read on the
engine thread between steps (engine.server.bridge.READS). `/generate` is the OpenAI completion
path with SGLang's body and response shape, so it validates and streams exactly as
`/v1/completions` does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.server.errors import bad


class Endpoints(Protocol):
    """What these routes use of the OpenAI endpoints (openai.app.Endpoints), which mount them:
    a protocol, so this module does not import the one that imports it."""

    api: Any
    engine: Any

    def parse(self, obj: Any, endpoint: Any) -> Any: ...

    def event_stream(self, body: AsyncIterator[bytes], gen: Any) -> Response: ...

    async def start(self, req: Any, source: str = "http") -> tuple[Any, Any]: ...

    async def read_json(self, request: Request) -> Any: ...


Message = dict[str, Any]
HEALTH_GENERATE_TIMEOUT_S = 20.0
# SGLang's sampling_params → the OpenAI completion field that means the same
SAMPLING_FIELDS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "seed": "seed",
    "sampling_seed": "seed",
    "n": "n",
}
# fields the gateway (0.3.2) adds to every /generate body: accepted at these values, refused
# (400) at any other, since we cannot honour them; `None` here means any bool (no effect on output)
GENERATE_FLAGS: dict[str, bool | None] = {
    "return_logprob": False,
    "return_text_in_logprobs": False,
    "return_hidden_states": False,
    "return_bytes": False,
    "return_entropy": False,
    "background": False,
    "log_metrics": None,
    "no_logs": None,
}
# SGLang's defaults where they differ from OpenAI's (python/sglang/srt/sampling/sampling_params.py)
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


class SglangWorker:
    """The routes, over the OpenAI endpoints' engine glue (`Endpoints`)."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.ep = endpoints
        self.api = endpoints.api
        self.engine = endpoints.engine

    def routes(self, wrap: Callable[[Callable[[Request], Awaitable[Response]]], Any]) -> list:
        return [
            Route("/server_info", wrap(self._server_info), methods=["GET"]),
            Route("/get_server_info", wrap(self._server_info), methods=["GET"]),
            Route("/model_info", wrap(self._model_info), methods=["GET"]),
            Route("/get_model_info", wrap(self._model_info), methods=["GET"]),
            Route("/get_load", wrap(self._load), methods=["GET"]),
            Route("/health_generate", wrap(self._health_generate), methods=["GET"]),
            Route("/flush_cache", wrap(self._flush_cache), methods=["POST", "GET"]),
            Route("/generate", wrap(self._generate), methods=["POST"]),
        ]

    # -- endpoints ---------------------------------------------------------------------------
    def _model_path(self) -> str:
        """The model's local directory (the gateway loads its tokenizer from there, where a
        bare name would send it to the Hugging Face hub)."""
        return str(getattr(self.engine.tokenizer, "name_or_path", "") or self.engine.info.model)

    async def _server_info(self, request: Request) -> Response:
        info = self.engine.info
        live = await self.api.read("config")
        load = await self.api.read("load")
        return JSONResponse({
            "model_path": self._model_path(),
            "tokenizer_path": self._model_path(),
            "served_model_name": self.api.model,
            "dp_size": 1,
            "tp_size": info.tp_size,
            "device": info.device,
            "dtype": info.dtype,
            "page_size": info.page_size,
            "max_total_num_tokens": info.num_pages * info.page_size,
            "max_running_requests": info.max_running_req,
            "context_length": info.max_seq_len,
            "chunked_prefill_size": live["max_extend_tokens"],
            "schedule_policy": live["policy"],
            "disable_radix_cache": info.cache_type != "radix",
            "attention_backend": info.attention_backend,
            "version": "stepscope",
            "internal_states": [{"load": load, **live}],
        })  # fmt: skip

    async def _model_info(self, request: Request) -> Response:
        info = self.engine.info
        return JSONResponse({
            "model_path": self._model_path(),
            "tokenizer_path": self._model_path(),
            "is_generation": True,
            "model_type": info.architecture.lower(),
            "architectures": [info.architecture],
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        })  # fmt: skip

    async def _load(self, request: Request) -> Response:
        # SGLang answers one entry per data-parallel rank; a stepscope replica is one rank
        return JSONResponse([await self.api.read("load")])

    async def _health_generate(self, request: Request) -> Response:
        """A real one-token generation through the engine, as SGLang's: 200 once it ends."""
        req = self.ep.parse({"prompt": [self._probe_token()], "max_tokens": 1, "temperature": 0},
                            "completion")  # fmt: skip
        gen, _ = await self.ep.start(req, source="health")
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async for _ in gen.text_batches():
                    pass
        except TimeoutError:
            return Response("the engine did not generate in time", status_code=503)
        finally:
            gen.close()
        if gen.error is not None:
            return Response(str(gen.error), status_code=503)
        return Response(status_code=200)

    def _probe_token(self) -> int:
        tok = self.engine.tokenizer
        bos = getattr(tok, "bos_token_id", None)
        return int(bos) if bos is not None else 0

    async def _flush_cache(self, request: Request) -> Response:
        freed = await self.api.read("flush_cache")  # None under running or waiting requests
        if freed is None:
            return Response(
                "Cache not flushed because there are pending requests.", status_code=400
            )
        return Response(f"Cache flushed ({freed} pages freed).", status_code=200)

    async def _generate(self, request: Request) -> Response:
        body = await self.ep.read_json(request)
        oai = to_completion_body(body)
        req = self.ep.parse(oai, "completion")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise bad("rid must be a string", param="rid")
        t0 = time.monotonic()
        gen, head = await self.ep.start(req, source="http")
        meta_id = rid or head.id

        def meta() -> Message:
            reason = gen.finish_reason
            finish = None
            if gen.done:
                finish = {"type": "length", "length": gen.usage.completion_tokens}
                if reason != "length":
                    finish = {"type": "abort"} if reason == "abort" else {"type": "stop"}
            return {
                "id": meta_id,
                "finish_reason": finish,
                "prompt_tokens": gen.usage.prompt_tokens,
                "completion_tokens": gen.usage.completion_tokens,
                "e2e_latency": time.monotonic() - t0,
            }

        if req.stream:
            return self.ep.event_stream(self._stream(gen, meta), gen)
        try:
            text = "".join([p async for batch in gen.text_batches() for p in batch])
        finally:
            gen.close()
        if gen.error is not None:
            raise gen.error
        return JSONResponse({"text": text, "meta_info": meta()})

    async def _stream(self, gen: Any, meta: Callable[[], Message]) -> AsyncIterator[bytes]:
        # SGLang streams the text so far in every chunk (not only the new piece)
        text = ""
        async for pieces in gen.text_batches():
            text += "".join(pieces)
            yield _sse({"text": text, "meta_info": meta()})
        if gen.error is not None:
            yield _sse(gen.error.body())
        else:
            yield _sse({"text": text, "meta_info": meta()})
        yield b"data: [DONE]\n\n"


def to_completion_body(body: Any) -> Message:
    """SGLang's `/generate` body → an OpenAI completion body; ApiError(400) for what the
    translation cannot carry (never dropped silently)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad("give exactly one of text and input_ids", param="text")
    prompt = text if text is not None else ids
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise bad("a batch of prompts in one /generate is not supported: send one each",
                  param="text")  # fmt: skip
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise bad("sampling_params must be an object", param="sampling_params")
    out: Message = {"prompt": prompt, "stream": bool(body.get("stream", False))}
    out["max_tokens"] = SGLANG_DEFAULT_MAX_NEW_TOKENS
    for key, value in sp.items():
        if value is None:
            continue
        if key not in SAMPLING_FIELDS:
            raise bad(f"sampling_params.{key} is not supported by this server",
                      param=f"sampling_params.{key}")  # fmt: skip
        out[SAMPLING_FIELDS[key]] = value
    if body.get("model") is not None:
        out["model"] = body["model"]  # checked against the served names, as on /v1
    for key, value in body.items():
        if key in ("text", "input_ids", "sampling_params", "stream", "rid", "model"):
            continue
        if key not in GENERATE_FLAGS:
            raise bad(f"{key} is not supported by this server", param=key)
        want = GENERATE_FLAGS[key]
        if value is not None and not isinstance(value, bool):
            raise bad(f"{key} must be a boolean", param=key)
        if want is not None and value not in (None, want):
            raise bad(f"{key}={value!r} is not supported by this server", param=key)
    return out


def _sse(obj: Message) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
