"""Errors the engine raises for bad input; each carries the protocol's error `code`."""

from __future__ import annotations


class EngineError(Exception):
    code: str = "internal"


class InvalidRequest(EngineError, ValueError):
    """A missing, mistyped or out-of-range field, or an empty prompt."""

    code = "invalid_request"


class TooLarge(InvalidRequest):
    """The prompt plus `max_tokens` can never fit: beyond `max_seq_len` or the whole KV pool."""

    code = "too_large"


class NotFound(EngineError, KeyError):
    """An abort of a uid that is unknown or has already ended."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "not found"


class ModelNotFound(EngineError, FileNotFoundError):
    code = "model_not_found"


class Capacity(EngineError):
    """Too many requests are already waiting (the server's --max-waiting): try later."""

    code = "capacity"
