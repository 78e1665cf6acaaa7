"""Parse and validate client commands (docs/protocol.md, client → server) into typed records.

Validation is strict and never clamps: a bool is not an integer, 64.0 is not an integer, NaN and
infinities are not numbers, and a value out of range is an `invalid_request`. Whether a prompt
fits (`too_large`) or a uid exists (`not_found`) is the engine's call, not this module's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from instrumentation.errors import InvalidRequest
from instrumentation.messages import ErrorCode
from instrumentation.protocol import ADMISSION_MODES
from instrumentation.sampling import SamplingParams  # torch-free: it imports torch only to sample

# Bounds that keep a hostile integer from reaching the engine's tensors (int64 seeds, token ids).
MAX_SEED = 2**63 - 1
MAX_INT_FIELD = 2**31 - 1


class CommandError(Exception):
    """A command that gets an `error` reply; the connection stays open."""

    def __init__(self, code: ErrorCode, message: str, command_id: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.command_id = command_id


@dataclass(frozen=True, slots=True)
class Submit:
    id: str | None
    prompt: str | list[int]
    params: SamplingParams = SamplingParams()
    chat: bool = False


@dataclass(frozen=True, slots=True)
class Abort:
    id: str | None
    uid: int


@dataclass(frozen=True, slots=True)
class SetConfig:
    id: str | None
    max_extend_tokens: int | None
    policy: str | None
    admission: str | None = None


@dataclass(frozen=True, slots=True)
class Stats:
    """Extension: engine counters plus a page-accounting integrity check (docs/protocol.md)."""

    id: str | None


@dataclass(frozen=True, slots=True)
class KVMap:
    """Extension: the KV pool page by page, run-length encoded (docs/protocol.md)."""

    id: str | None


Command = Submit | Abort | SetConfig | Stats | KVMap


def parse_command(frame: str | bytes, *, vocab_size: int, policies: tuple[str, ...]) -> Command:
    """One frame → one command, or `CommandError` with the protocol's code and the echoed id."""
    obj = _load_object(frame)
    command_id = obj.get("id")
    if command_id is not None and not isinstance(command_id, str):
        raise CommandError("invalid_request", "id must be a string")
    kind = obj.get("type")
    try:
        if kind == "submit":
            return _submit(obj, command_id, vocab_size)
        if kind == "abort":
            return Abort(command_id, _int(obj, "uid", lo=0, hi=MAX_SEED))
        if kind == "set_config":
            return _set_config(obj, command_id, policies)
        if kind == "stats":
            return Stats(command_id)
        if kind == "kv_map":
            return KVMap(command_id)
    except CommandError as exc:
        exc.command_id = command_id
        raise
    shown = kind if isinstance(kind, str) else json.dumps(kind)
    raise CommandError("unknown_type", f"unknown command type {shown[:64]!r}", command_id)


def _load_object(frame: str | bytes) -> dict[str, Any]:
    if isinstance(frame, bytes):
        raise CommandError("invalid_json", "binary frames are not accepted; send JSON text")
    try:
        obj = json.loads(frame, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        # RecursionError: deeply nested arrays fit easily in one 1 MiB frame.
        raise CommandError("invalid_json", f"not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(obj, dict):
        raise CommandError("invalid_json", "a command must be a JSON object")
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _submit(obj: dict[str, Any], command_id: str | None, vocab_size: int) -> Submit:
    has_text, has_ids = "prompt" in obj, "input_ids" in obj
    if has_text == has_ids:
        raise CommandError("invalid_request", "give exactly one of prompt or input_ids")
    prompt: str | list[int]
    if has_text:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise CommandError("invalid_request", "prompt must be a non-empty string")
        if not _is_utf8(prompt):  # a JSON escape can smuggle in a lone surrogate
            raise CommandError("invalid_request", "prompt is not valid Unicode")
    else:
        prompt = _input_ids(obj["input_ids"], vocab_size)
    chat = _bool(obj, "chat", False)
    if chat and has_ids:
        raise CommandError("invalid_request", "chat applies to a text prompt, not input_ids")
    seed = None
    if obj.get("seed") is not None:  # an explicit null means no seed, as does leaving it out
        seed = _int(obj, "seed", lo=0, hi=MAX_SEED)
    # JSON types here; the ranges are SamplingParams' own checks, the same as for LLM users
    try:
        params = SamplingParams(
            # No upper bound here: a max_tokens that can never fit is the engine's `too_large`.
            max_tokens=_int(obj, "max_tokens", lo=None, hi=None, default=64),
            temperature=_number(obj, "temperature", default=0.0),
            top_k=_int(obj, "top_k", lo=None, hi=vocab_size, default=-1),
            top_p=_number(obj, "top_p", default=1.0),
            ignore_eos=_bool(obj, "ignore_eos", False),
            seed=seed,
        )
    except InvalidRequest as e:
        raise CommandError("invalid_request", str(e)) from None
    return Submit(id=command_id, prompt=prompt, params=params, chat=chat)


def _set_config(
    obj: dict[str, Any], command_id: str | None, policies: tuple[str, ...]
) -> SetConfig:
    budget = None
    if "max_extend_tokens" in obj:
        budget = _int(obj, "max_extend_tokens", lo=1, hi=MAX_INT_FIELD)
    policy = None
    if "policy" in obj:
        policy = obj["policy"]
        if not isinstance(policy, str) or policy not in policies:
            raise CommandError("invalid_request", f"policy must be one of {', '.join(policies)}")
    admission = None
    if "admission" in obj:
        admission = obj["admission"]
        if not isinstance(admission, str) or admission not in ADMISSION_MODES:
            raise CommandError(
                "invalid_request", f"admission must be one of {', '.join(ADMISSION_MODES)}"
            )
    return SetConfig(command_id, budget, policy, admission)


def _input_ids(value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise CommandError("invalid_request", "input_ids must be a non-empty list of integers")
    for tok in value:
        if type(tok) is not int:
            raise CommandError("invalid_request", "input_ids must hold integers only")
        if not 0 <= tok < vocab_size:
            raise CommandError("invalid_request", f"token id {tok} is outside [0, {vocab_size})")
    return value


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _int(
    obj: dict[str, Any], name: str, *, lo: int | None, hi: int | None, default: Any = ...
) -> Any:
    if name not in obj:
        if default is ...:
            raise CommandError("invalid_request", f"{name} is required")
        return default
    value = obj[name]
    # type() rather than isinstance(): bool is a subclass of int but `true` is not a count.
    if type(value) is not int:
        raise CommandError("invalid_request", f"{name} must be an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise CommandError("invalid_request", f"{name} must be an integer {bound}")
    return value


def _number(obj: dict[str, Any], name: str, *, default: float) -> float:
    if name not in obj:
        return default
    value = obj[name]
    try:
        # float() of a 400-digit integer raises OverflowError; both mean "not a usable number".
        number = float(value) if type(value) in (int, float) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number):
        raise CommandError("invalid_request", f"{name} must be a finite number")
    return number


def _bool(obj: dict[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise CommandError("invalid_request", f"{name} must be true or false")
    return value
