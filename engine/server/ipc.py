"""The wire between the engine process and the API process: two ZMQ socket pairs over ipc://.

- **calls**: the API's DEALER to the engine's ROUTER. Each call travels as one frame,
  `pickle((call_id, method, kwargs))`; its reply `pickle((call_id, ok, value))`, where `value` is
  the result or, when not ok, the error as `(class name, message)`. A call_id of None asks for no
  reply (an abort whose outcome nobody waits for).
- **events**: the engine's PUSH to the API's PULL. One multipart message per flushed batch, each
  frame one protocol message serialized once (JSON bytes, broadcasts numbered with `seq`): the
  API process parses them for its folds and sends the same bytes to every WebSocket client. A
  message of the single frame `END` ends the stream: the engine stopped.

Ordering across the two: a submit's reply may arrive after the first events of the uid it names;
the API's router holds such messages until the reply comes (openai.api.Router). Pickle is safe
here: both ends are this program, and the sockets live in a directory only its user can open.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from instrumentation import errors
from instrumentation.protocol import BROADCAST_TYPES

END = b"stepscope:end"  # the last frame on the event socket: the engine stopped
CALL_TIMEOUT_S = 30.0  # a call the engine should answer at once (not the reads between steps)
Message = dict[str, Any]


def endpoints(directory: str | Path) -> tuple[str, str]:
    """The calls' and the events' ipc:// addresses in `directory`."""
    d = Path(directory)
    return f"ipc://{d / 'calls'}", f"ipc://{d / 'events'}"


def encode_call(call_id: int | None, method: str, kwargs: dict[str, Any]) -> bytes:
    return pickle.dumps((call_id, method, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes) -> Any:
    return pickle.loads(frame)


def encode_reply(call_id: int, ok: bool, value: Any) -> bytes:
    if not ok:
        assert isinstance(value, BaseException)
        value = (type(value).__name__, str(value))
    return pickle.dumps((call_id, ok, value), protocol=pickle.HIGHEST_PROTOCOL)


def rebuild_error(name: str, message: str) -> Exception:
    """The engine's error on this side: the same class for the engine's own errors."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.EngineError):
        return cls(message)
    return errors.EngineError(f"{name}: {message}")


def dumps(msg: Message) -> bytes:
    """One message as JSON bytes: orjson (20x faster than json on a token), or json for what
    orjson refuses (a lone surrogate in a prompt's text, say)."""
    try:
        return orjson.dumps(msg)
    except TypeError:
        return json.dumps(msg).encode()


def loads(frame: bytes) -> Message:
    return orjson.loads(frame)


class EventEncoder:
    """Numbers the broadcasts (`seq`, protocol v1.1) and serializes each message once."""

    def __init__(self) -> None:
        self.seq = -1  # the last broadcast's; the first is 0

    def encode(self, items: Iterable[Any]) -> list[bytes]:
        frames = []
        for item in items:
            msg = item if isinstance(item, dict) else item.to_dict()
            if msg.get("type") in BROADCAST_TYPES:
                self.seq += 1
                msg["seq"] = self.seq
            frames.append(dumps(msg))
        return frames
