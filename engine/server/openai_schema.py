"""The OpenAI request and response shapes: strict parsing of a request body into a typed record,
the response and stream-chunk dicts, and stop-string matching. Pure functions, no I/O.

Parsing follows what vLLM accepts from common clients: `max_completion_tokens` as well as
`max_tokens`, message `content` as a string or a list of text parts, `stream_options` with
`include_usage` and `continuous_usage_stats`, and vLLM's `top_k` and `ignore_eos`. Fields that
would change the result but that this engine cannot honour (logprobs, penalties, n > 1, ...) are
refused with a 400 rather than ignored; fields that change nothing (user, metadata) are ignored.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

Endpoint = Literal["completion", "chat"]
Message = dict[str, Any]

# OpenAI's finish reasons, from the engine's: an EOS token is a natural stop
FINISH_REASONS = {"eos": "stop", "length": "length"}
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
CHAT_ROLES = frozenset(("system", "user", "assistant", "developer"))

# Accepted only at a value that changes nothing; anything else is a 400 naming the field.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "tools": ([],),
    "stop_token_ids": ([],),
    "response_format": ({"type": "text"},),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> Message:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": err}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated completion or chat request."""

    endpoint: Endpoint
    model: str | None
    prompt: str | list[int] | None = None  # completions
    messages: tuple[Message, ...] = ()  # chat: {"role", "content": str}
    max_tokens: int | None = None  # None: as many as the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


def parse_request(obj: Any, endpoint: Endpoint) -> GenerationRequest:
    """A decoded JSON body → a GenerationRequest, or ApiError(400) naming the bad field."""
    if not isinstance(obj, dict):
        raise bad("the request body must be a JSON object")
    body = {k: v for k, v in obj.items() if v is not None}  # null means "not given"
    for name, neutral in NEUTRAL.items():
        if name in body and not _same(body[name], neutral):
            raise bad(f"{name}={body[name]!r} is not supported by this server", param=name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", param="model")
    prompt: str | list[int] | None = None
    messages: tuple[Message, ...] = ()
    if endpoint == "completion":
        prompt = _prompt(body.get("prompt"))
    else:
        messages = _messages(body.get("messages"))
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream=true", param="stream_options")
        if not isinstance(options, dict):
            raise bad("stream_options must be an object", param="stream_options")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
        continuous = _bool(
            options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats"
        )
    max_tokens = _max_tokens(body)
    top_k = _int(body, "top_k", -1)
    if top_k == 0:  # vLLM's and Hugging Face's "no top-k"
        top_k = -1
    if top_k < -1:
        raise bad("top_k must be -1, 0 or an integer >= 1", param="top_k")
    seed = body.get("seed")
    if seed is not None:
        seed = _int(body, "seed", 0)
        if not 0 <= seed <= MAX_SEED:
            raise bad(f"seed must be an integer in [0, {MAX_SEED}]", param="seed")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad("temperature must be >= 0", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p must be in (0, 1]", param="top_p")
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=_bool(body, "ignore_eos", False),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
    )


def _same(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type-strict: `True` is not the neutral `1`, `1.5` is not `1`
    return any(type(value) is type(n) and value == n for n in neutral)


def _prompt(value: Any) -> str | list[int]:
    # a one-element batch is one prompt; longer batches need n prompts → not supported
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad("prompt must not be empty", param="prompt")
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise bad("one prompt per request: batches of prompts are not supported", "prompt")
    raise bad("prompt must be a non-empty string or list of token ids", param="prompt")


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}", where)
        content = _content(msg.get("content"), f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _content(value: Any, where: str) -> str:
    """A string, or a list of text parts joined (as vLLM joins them, with newlines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: only text parts are supported", param=where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}: a text part needs a string `text`", param=where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where} must be a string or a list of text parts", param=where)


def _max_tokens(body: dict[str, Any]) -> int | None:
    # max_completion_tokens is the newer name; a client may send both, as the openai SDK can
    for name in ("max_completion_tokens", "max_tokens"):
        if name in body:
            value = _int(body, name, 0)
            if value < 1:
                raise bad(f"{name} must be an integer >= 1, got {value}", param=name)
            return value
    return None


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return tuple(s for s in stops if s)  # an empty stop string matches nothing (as in vLLM)


def _int(obj: dict[str, Any], name: str, default: int) -> int:
    value = obj.get(name, default)
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer() and abs(value) < 2**53:
        return int(value)  # JSON has one number type; 16.0 is 16 (as pydantic accepts it)
    raise bad(f"{name} must be an integer", param=name)


def _number(obj: dict[str, Any], name: str, default: float) -> float:
    value = obj.get(name, default)
    try:
        number = float(value) if type(value) in (int, float) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number):
        raise bad(f"{name} must be a finite number", param=name)
    return number


def _bool(obj: dict[str, Any], name: str, default: bool, shown: str | None = None) -> bool:
    value = obj.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{shown or name} must be true or false", param=shown or name)
    return value


class StopMatcher:
    """Finds the first stop string in text that arrives in pieces.

    `push` returns the text that is safe to show now: everything except a tail that could still
    become the start of a stop string (held back, as vLLM does). `stopped` is set once a stop
    string is complete; the text before it is then all that is ever shown.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything generated so far, stop string included
        self.shown = 0  # characters of `text` returned so far
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.hold)  # a match may begin in the held tail
        self.text += piece
        if self.stops:
            hits = [i for s in self.stops if (i := self.text.find(s, start)) != -1]
            if hits:
                self.stopped = True
                self.text = self.text[: min(hits)]
                return self._show(len(self.text))
        return self._show(max(self.shown, len(self.text) - self.hold))

    def flush(self) -> str:
        """At the end of generation: the held-back tail (nothing after a stop)."""
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        out = self.text[self.shown : upto]
        self.shown = max(self.shown, upto)
        return out


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_dict(self) -> Message:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every response and chunk of one request repeats."""

    id: str
    model: str
    endpoint: Endpoint
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, obj: str) -> Message:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> Message:
        if self.endpoint == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = self._base("text_completion")
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            out = self._base("chat.completion")
        return {**out, "choices": [choice], "usage": usage.to_dict()}

    def chunk(self, text: str, finish_reason: str | None = None, *, role: bool = False) -> Message:
        if self.endpoint == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {**self._base("text_completion"), "choices": [choice]}
        delta: Message = {"role": "assistant", "content": text} if role else {}
        if text and not role:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> Message:
        obj = "text_completion" if self.endpoint == "completion" else "chat.completion.chunk"
        return {**self._base(obj), "choices": [], "usage": usage.to_dict()}
