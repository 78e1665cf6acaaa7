"""The OpenAI response shapes: whole responses, stream chunks, usage and logprobs, as dicts ready
for JSON. Pure functions, no I/O.

Logprobs come as `TokenLogprob` records (a token id, its log-probability and the top
alternatives' ids and log-probabilities, None for a prompt's first token) and are written in
each endpoint's shape: completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (the
top dict includes the chosen token, as vLLM's does) and chat's `{content: [{token, logprob,
bytes, top_logprobs}]}`. Token strings are each id decoded alone, as vLLM writes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.server.errors import Endpoint

Message = dict[str, Any]
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: tuple[tuple[int, float], ...] = ()


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


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(
    entries: list[TokenLogprob], decode: Callable[[int], str], offset: int = 0
) -> Message:
    """Completions' shape; `offset`: where the first token's text starts in the choice's text."""
    tokens, chosen, tops, offsets = [], [], [], []
    for e in entries:
        text = decode(e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e.logprob is None:
            chosen.append(None)
            tops.append(None)
            continue
        chosen.append(_lp(e.logprob))
        top = {text: _lp(e.logprob)}
        for tid, lp in e.top:
            top.setdefault(decode(tid), _lp(lp))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], decode: Callable[[int], str]) -> Message:
    def one(tid: int, lp: float) -> Message:
        text = decode(tid)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        assert e.logprob is not None  # chat has no prompt logprobs
        entry = one(e.token_id, e.logprob)
        entry["top_logprobs"] = [one(tid, lp) for tid, lp in e.top]
        content.append(entry)
    return {"content": content}


@dataclass(slots=True)
class ChoiceOut:
    """One finished choice of a whole (not streamed) response."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: Message | None = None


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every response and chunk of one request repeats."""

    id: str
    model: str
    endpoint: Endpoint
    created: int = field(default_factory=lambda: int(time.time()))
    _templates: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, compare=False)

    def _base(self, obj: str) -> Message:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[ChoiceOut], usage: Usage) -> Message:
        out = []
        for c in choices:
            if self.endpoint == "completion":
                choice: Message = {"index": c.index, "text": c.text}
            else:
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text}}
            choice.update(logprobs=c.logprobs, finish_reason=c.finish_reason)
            out.append(choice)
        obj = "text_completion" if self.endpoint == "completion" else "chat.completion"
        return {**self._base(obj), "choices": out, "usage": usage.to_dict()}

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        logprobs: Message | None = None,
    ) -> Message:
        if self.endpoint == "completion":
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
            return {**self._base("text_completion"), "choices": [choice]}
        delta: Message = {"role": "assistant", "content": text} if role else {}
        if text and not role:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def text_chunk(self, index: int, text: str) -> bytes:
        """`chunk(index, text)` as its server-sent event, from a template made once per choice:
        only the text is encoded per token (the hot path of a stream)."""
        head, tail = self._templates.get(index) or self._template(index)
        if self.endpoint == "chat" and not text:
            return head[: -len(b'"content":')] + b"}" + tail[1:]  # an empty delta: {}
        return head + json.dumps(text).encode() + tail

    def _template(self, index: int) -> tuple[bytes, bytes]:
        mark = "\x00text\x00"
        body = json.dumps(self.chunk(index, mark), separators=(",", ":"))
        head, tail = body.encode().split(json.dumps(mark).encode())
        self._templates[index] = (b"data: " + head, tail + b"\n\n")
        return self._templates[index]

    def usage_chunk(self, usage: Usage) -> Message:
        obj = "text_completion" if self.endpoint == "completion" else "chat.completion.chunk"
        return {**self._base(obj), "choices": [], "usage": usage.to_dict()}
