"""Server → client messages that are not engine events: hello, accepted, error, config, stats.

Engine events (step, token, request) come from `instrumentation.records`; this module builds
the rest of docs/protocol.md's server messages so every reply has one definition.
"""

from __future__ import annotations

from typing import Any, Literal

from instrumentation import PROTOCOL_MINOR, PROTOCOL_VERSION

ErrorCode = Literal[
    "invalid_json", "unknown_type", "invalid_request", "too_large", "not_found", "capacity"
]
ERROR_CODES: frozenset[str] = frozenset(
    ("invalid_json", "unknown_type", "invalid_request", "too_large", "not_found", "capacity")
)

Message = dict[str, Any]


def hello(
    now: float,
    engine: dict[str, Any],
    config: dict[str, Any],
    history: dict[str, Any],
    seq: int | None = None,
) -> Message:
    """`seq`: the last broadcast that `history` includes (v1.1); None before the first."""
    return {
        "type": "hello",
        "protocol": PROTOCOL_VERSION,
        "protocol_minor": PROTOCOL_MINOR,
        "seq": -1 if seq is None else seq,
        "now": now,
        "engine": engine,
        "config": config,
        "history": history,
    }


def accepted(command_id: str | None, uid: int) -> Message:
    return {"type": "accepted", "id": command_id, "uid": uid}


def error(command_id: str | None, code: ErrorCode, message: str) -> Message:
    return {"type": "error", "id": command_id, "code": code, "message": message}


def config(command_id: str | None, t: float, values: dict[str, Any]) -> Message:
    return {"type": "config", "id": command_id, "t": t, **values}


def stats(command_id: str | None, t: float, values: dict[str, Any]) -> Message:
    """Reply to the `stats` extension (docs/protocol.md): engine and server counters."""
    return {"type": "stats", "id": command_id, "t": t, **values}


def kv_map(command_id: str | None, t: float, values: dict[str, Any]) -> Message:
    """Reply to the `kv_map` extension (docs/protocol.md): the pool page by page."""
    return {"type": "kv_map", "id": command_id, "t": t, **values}
