"""The OpenAI request bodies as pydantic v2 models (the convention of FastAPI and vLLM), parsed
into one typed record, `GenerationRequest`. Pure: no I/O.

Parsing follows what vLLM accepts from common clients: `max_completion_tokens` as well as
`max_tokens`, message `content` as a string or a list of text parts, `stream_options`, and
vLLM's extra sampling fields (`top_k`, `min_p`, `ignore_eos`, `include_stop_str_in_output`,
`skip_special_tokens`, `chat_template_kwargs`). A field that would change the result and that
this engine cannot honour (penalties, logit_bias, beam search, ...) is refused with a 400 unless
it has its neutral value; fields that change nothing (user, metadata) are ignored. `null` means
"not given" everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from engine.server.errors import ApiError, Endpoint, Message, bad
from instrumentation.sampling import MAX_LOGPROBS

__all__ = ["ApiError", "ChatBody", "CompletionBody", "GenerationRequest", "bad", "parse_request"]

Prompt = str | list[int]

MAX_STOP_STRINGS = 16
SEED_RANGE = (-(2**63), 2**64 - 1)  # any 64-bit integer, signed or not (torch's range)
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's and vLLM's default on /v1/completions

# Accepted only at a value that changes nothing; anything else is a 400 naming the field.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "length_penalty": (1, 1.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "tools": ([],),
    "tool_choice": ("none",),
    "stop_token_ids": ([],),
    "response_format": ({"type": "text"},),
    # vLLM's extras that would change the result, refused at any value but their neutral one
    "prompt_logprobs": (),  # vLLM's own shape of them; `echo` with `logprobs` gives OpenAI's
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "spaces_between_special_tokens": (True,),
    "continue_final_message": (False,),
    "functions": (),
    "reasoning_effort": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
}


# -- field types: JSON has one number type, so 16.0 is the integer 16; true is never a number --
def _integral(value: Any) -> Any:
    if type(value) is float and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if type(value) is not int:
        raise ValueError("must be an integer")
    return value


def _finite(value: Any) -> Any:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError("must be a finite number")
    return float(value)


Int = Annotated[int, BeforeValidator(_integral)]
Number = Annotated[float, BeforeValidator(_finite)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Logprobs = Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_and_drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic's own error: an object is needed
        for name, neutral in NEUTRAL.items():
            value = data.get(name)
            if value is not None and not any(type(value) is type(n) and value == n
                                             for n in neutral):  # fmt: skip
                # not a ValueError: pydantic lets it through, with the field's name
                raise bad(f"{name}={value!r} is not supported by this server", param=name)
        return {k: v for k, v in data.items() if v is not None}


class StreamOptions(_Body):
    include_usage: StrictBool = True  # vLLM's default once stream_options is given
    continuous_usage_stats: StrictBool = False


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]

    def as_dict(self) -> Message:
        text = self.content
        if not isinstance(text, str):  # text parts joined with newlines, as vLLM joins them
            text = "\n".join(p.text for p in text)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class _Sampling(_Body):
    model: StrictStr | None = None
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    seed: Annotated[Int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    n: Annotated[Int, Field(ge=1, le=128)] = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_tokens_as_token_ids: StrictBool = False  # logprobs' tokens as "token_id:123"
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class CompletionBody(_Sampling):
    prompt: (
        Annotated[StrictStr, Field(min_length=1)]
        | TokenIds
        | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    echo: StrictBool = False
    logprobs: Logprobs | None = None
    add_special_tokens: Literal[True] = True  # the tokenizer's BOS and the like, as vLLM's


class ChatBody(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Logprobs | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    add_generation_prompt: StrictBool = True
    echo: Literal[False] = False
    add_special_tokens: Literal[False] = False  # the template has them, as vLLM's default

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated completion or chat request. Sampling fields left None take the model's
    generation_config.json defaults, if any, then OpenAI's."""

    endpoint: Endpoint
    model: str | None
    prompts: tuple[Prompt, ...] = ()  # completions: one choice set per prompt
    messages: tuple[Message, ...] = ()  # chat: {"role", "content": str}
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top alternatives per token; 0: the chosen token's only
    tokens_as_ids: bool = False
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False

    @property
    def choices(self) -> int:
        return self.n * max(1, len(self.prompts))


def parse_request(body: bytes | str | Any, endpoint: Endpoint) -> GenerationRequest:
    """A request body (raw JSON, or already decoded) → a GenerationRequest, or ApiError(400)
    naming the bad field. Raw JSON with a lone surrogate (`"\\ud800"`) is invalid JSON."""
    model = CompletionBody if endpoint == "completion" else ChatBody
    try:
        if isinstance(body, bytes | str):
            parsed = model.model_validate_json(body)
        else:
            parsed = model.model_validate(body)
    except ValidationError as exc:
        raise _api_error(exc) from None
    return _to_request(parsed, endpoint)


# fields of several shapes: one message for all, not the first shape's complaint
SHAPES = {
    "prompt": "prompt must be a non-empty string, a list of token ids, or a list of either",
    "stop": f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings",
    "content": "content must be a string or a non-empty list of text parts",
}


def _api_error(exc: ValidationError) -> ApiError:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return bad(f"the body is not valid JSON: {err['msg'][:120]}")
    if err["type"] == "model_type" and not err["loc"]:
        return bad("the request body must be a JSON object")
    # a union's failures name the branch (`str`, `list[int]`): keep only the field's path
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or "[" not in str(p)]
    loc = [p for p in loc if p not in ("str", "function-after", "constrained-str")]
    param = ".".join(loc) or None
    if loc and (shape := SHAPES.get(loc[-1] if loc[-1] in SHAPES else loc[0])):
        kind = err["type"]
        if kind.endswith(("_type", "_parsing", "too_short", "too_long", "literal_error")):
            return bad(f"{param}: {shape}", param=param)
    msg = str(err["msg"]).removeprefix("Value error, ")
    return bad(f"{param}: {msg}" if param else msg, param=param)


def _to_request(body: CompletionBody | ChatBody, endpoint: Endpoint) -> GenerationRequest:
    options = body.stream_options
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    common: dict[str, Any] = {
        "endpoint": endpoint,
        "model": body.model,
        # max_completion_tokens is the newer name; the openai SDK may send both
        "max_tokens": body.max_completion_tokens or body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": -1 if body.top_k == 0 else body.top_k,  # 0: vLLM's and HF's "no top-k"
        "min_p": body.min_p,
        "seed": body.seed,
        "n": body.n,
        "ignore_eos": body.ignore_eos,
        "stop": tuple(s for s in stops if s),  # an empty stop string matches nothing (vLLM)
        "include_stop_str": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "tokens_as_ids": body.return_tokens_as_token_ids,
        "stream": body.stream,
        "include_usage": options is not None and options.include_usage,
        "continuous_usage": options is not None and options.continuous_usage_stats,
    }
    if isinstance(body, CompletionBody):
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: tuple[Prompt, ...] = (prompt,)  # type: ignore[assignment]
        else:
            prompts = tuple(prompt)  # type: ignore[arg-type]
        return GenerationRequest(prompts=prompts, echo=body.echo, logprobs=body.logprobs, **common)
    return GenerationRequest(
        messages=tuple(m.as_dict() for m in body.messages),
        chat_template_kwargs=dict(body.chat_template_kwargs),
        add_generation_prompt=body.add_generation_prompt,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        **common,
    )
