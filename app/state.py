"""The recorded-events store: folds protocol messages into steps, request records and a raw log.

One store per engine connection, written by the connection thread and read by every browser tab,
so every method takes the lock and readers get copies (`Snapshot`), never live structures.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

MAX_STEPS = 20_000
MAX_LOG = 200_000
MAX_ENDED_REQUESTS = 2_000
MAX_REPLIES = 500
ENDED_STATES = frozenset({"finished", "aborted", "rejected"})


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of the store: what one redraw of the page is built from."""

    steps: list[Message]
    requests: list[Message]
    engine: dict[str, Any] | None
    config: dict[str, Any] | None
    version: int
    messages_seen: int = 0

    @property
    def page_size(self) -> int:
        return int((self.engine or {}).get("page_size") or 1)


def _new_record(uid: int) -> Message:
    # The shape of a `hello.history.requests` record, so history and live events fold alike.
    return {
        "uid": uid,
        "state": "waiting",
        "prompt_len": None,
        "cached_len": None,
        "output_len": 0,
        "max_tokens": None,
        "t_queued": None,
        "t_first_token": None,
        "t_finished": None,
        "text": "",
    }


class EventStore:
    """Everything one engine connection has said, bounded in memory."""

    def __init__(self, max_steps: int = MAX_STEPS, max_log: int = MAX_LOG) -> None:
        self._lock = threading.Lock()
        self._replied = threading.Condition(self._lock)
        self._steps: deque[Message] = deque(maxlen=max_steps)
        self._log: deque[Message] = deque(maxlen=max_log)
        self._requests: dict[int, Message] = {}
        self._replies: OrderedDict[str, Message] = OrderedDict()
        self._engine: dict[str, Any] | None = None
        self._config: dict[str, Any] | None = None
        self._last_t = float("-inf")
        self._cleared_through_step = -1
        self._cleared_uids: set[int] = set()
        self._version = 0
        self._seen = 0

    # ---- writing (the connection thread) -------------------------------------------------

    def apply(self, msg: Message) -> None:
        """Fold one server message into the store."""
        kind = msg.get("type")
        with self._lock:
            self._seen += 1
            if kind != "hello":
                self._log.append(msg)
            if kind == "hello":
                self._apply_hello(msg)
            elif kind == "step":
                self._steps.append(msg)
                self._last_t = max(self._last_t, float(msg.get("t1", self._last_t)))
            elif kind == "request":
                self._apply_request(msg)
            elif kind == "token":
                rec = self._record(int(msg["uid"]))
                if rec["state"] not in ENDED_STATES:
                    rec["text"] += str(msg.get("text", ""))
                    rec["output_len"] = int(rec.get("output_len") or 0) + 1
            elif kind == "config":
                self._config = {
                    "max_extend_tokens": msg.get("max_extend_tokens"),
                    "policy": msg.get("policy"),
                }
            if kind in ("accepted", "error", "config") and msg.get("id") is not None:
                self._replies[str(msg["id"])] = msg
                while len(self._replies) > MAX_REPLIES:
                    self._replies.popitem(last=False)
                self._replied.notify_all()
            self._version += 1

    def _apply_hello(self, msg: Message) -> None:
        history = msg.get("history") or {}
        steps = [s for s in history.get("steps") or [] if isinstance(s, dict)]
        now = float(msg.get("now") or 0.0)
        # An engine clock behind what we saw means a different (restarted) engine: start afresh.
        if now < self._last_t:
            self._reset()
        self._log.append(msg)
        self._engine = dict(msg.get("engine") or {})
        self._config = dict(msg.get("config") or {})
        steps = [s for s in steps if int(s.get("step", -1)) > self._cleared_through_step]
        if steps:
            first = int(steps[0]["step"])
            kept = [s for s in self._steps if int(s["step"]) < first]
            self._steps.clear()
            self._steps.extend(kept)
            self._steps.extend(steps)
            self._last_t = max(self._last_t, float(steps[-1].get("t1", 0.0)))
        for rec in history.get("requests") or []:
            if int(rec["uid"]) not in self._cleared_uids:
                self._record(int(rec["uid"])).update(rec)
        self._last_t = max(self._last_t, now)

    def _apply_request(self, msg: Message) -> None:
        rec = self._record(int(msg["uid"]))
        event, t = msg.get("event"), msg.get("t")
        if event == "queued":
            rec.update(state="waiting", t_queued=t, prompt_len=msg.get("prompt_len"))
            rec["max_tokens"] = msg.get("max_tokens")
        elif event == "admitted":
            rec.update(state="running", cached_len=msg.get("cached_len"), t_admitted=t)
        elif event == "first_token":
            rec["t_first_token"] = t
            if rec["state"] == "waiting":
                rec["state"] = "running"
        elif event in ENDED_STATES:
            rec.update(state=event, t_finished=t)
            for key in ("output_len", "finish_reason", "text", "message"):
                if key in msg:
                    rec[key] = msg[key]
            self._trim_ended()

    def _record(self, uid: int) -> Message:
        rec = self._requests.get(uid)
        if rec is None:
            rec = self._requests[uid] = _new_record(uid)
        return rec

    def _trim_ended(self) -> None:
        ended = [u for u, r in self._requests.items() if r["state"] in ENDED_STATES]
        for uid in ended[: max(0, len(ended) - MAX_ENDED_REQUESTS)]:
            del self._requests[uid]

    def _reset(self) -> None:
        self._steps.clear()
        self._log.clear()
        self._requests.clear()
        self._last_t = float("-inf")
        self._cleared_through_step = -1
        self._cleared_uids.clear()

    def clear(self) -> None:
        """Forget recorded steps and ended requests; requests in flight keep their records."""
        with self._lock:
            if self._steps:
                self._cleared_through_step = int(self._steps[-1]["step"])
            self._steps.clear()
            self._log.clear()
            for uid in [u for u, r in self._requests.items() if r["state"] in ENDED_STATES]:
                del self._requests[uid]
                self._cleared_uids.add(uid)
            self._version += 1

    # ---- reading (any thread) ------------------------------------------------------------

    def snapshot(self, last_steps: int | None = None) -> Snapshot:
        with self._lock:
            if last_steps is None or last_steps >= len(self._steps):
                steps = list(self._steps)
            else:
                steps = list(self._steps)[-last_steps:]
            return Snapshot(
                steps=steps,
                requests=[dict(r) for _, r in sorted(self._requests.items())],
                engine=dict(self._engine) if self._engine is not None else None,
                config=dict(self._config) if self._config is not None else None,
                version=self._version,
                messages_seen=self._seen,
            )

    def log(self) -> list[Message]:
        """Every recorded message, oldest first (the session trace)."""
        with self._lock:
            return list(self._log)

    @property
    def version(self) -> int:
        return self._version

    def wait_reply(self, command_id: str, timeout: float) -> Message | None:
        """The `accepted`, `config` or `error` message echoing `command_id`, or None on timeout."""
        with self._replied:
            self._replied.wait_for(lambda: command_id in self._replies, timeout=timeout)
            return self._replies.get(command_id)

    def reply(self, command_id: str) -> Message | None:
        with self._lock:
            return self._replies.get(command_id)
