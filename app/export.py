"""The session's trace as files: JSON lines of every recorded message, and a Chrome trace.

The Chrome conversion is instrumentation's (`instrumentation.trace`, pure Python, no torch);
this module only removes the steps a reconnect received twice (live, then in `hello.history`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from app.state import Message
from instrumentation.trace import to_chrome_trace


def jsonl_bytes(messages: Iterable[Message]) -> bytes:
    return "".join(json.dumps(m, separators=(",", ":")) + "\n" for m in messages).encode()


def unique_steps(messages: Iterable[Message]) -> list[Message]:
    """The messages with each engine step once, wherever it first appeared."""
    seen: set[int] = set()
    out: list[Message] = []
    for msg in messages:
        if msg.get("type") == "hello":
            history = msg.get("history") or {}
            fresh = [s for s in history.get("steps") or [] if s.get("step") not in seen]
            seen.update(s.get("step") for s in fresh)
            msg = {**msg, "history": {**history, "steps": fresh}}
        elif msg.get("type") == "step":
            if msg.get("step") in seen:
                continue
            seen.add(msg.get("step"))
        out.append(msg)
    return out


def chrome_trace_bytes(messages: Iterable[Message]) -> bytes:
    """A Chrome trace (Perfetto, chrome://tracing): engine steps, and one track per request."""
    return json.dumps(to_chrome_trace(unique_steps(messages))).encode()
