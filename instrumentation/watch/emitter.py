"""The watch's emitter: numbers protocol messages, keeps the history a late client needs, and
hands every message to the WebSocket publisher and the trace file.

Messages get their `seq` on the producing thread, under one lock, so two sources (forward-pass
metrics and KV events) interleave without reordering. The history is updated by a publisher
sink, on the server thread that also builds each `hello`, so a client never receives a message
twice (in its hello and again live) nor misses one. Without a publisher (the converter), the
sinks run on the producing thread.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from instrumentation import PROTOCOL_VERSION, messages
from instrumentation.publisher import Publisher, PublisherConfig, Sink
from instrumentation.trace import TraceWriter
from instrumentation.watch.aggregate import AggregateStep

Message = dict[str, Any]
SEQ_TYPES = frozenset(("step", "token", "request", "config"))  # docs/protocol.md v1.1 broadcasts
HISTORY_STEPS = 2000  # docs/protocol.md: hello carries at least the last 2,000 steps
NO_COMMANDS = (
    "this is a watch of an external engine: it reads the engine's output and cannot submit, "
    "abort or change its configuration"
)


class Emitter:
    def __init__(
        self,
        engine: dict[str, Any],
        *,
        history_steps: int = HISTORY_STEPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance = secrets.token_hex(8)
        # `external` and `commands` tell the page to disable submit and budget controls.
        self.engine: dict[str, Any] = {
            **engine,
            "instance": self.instance,
            "external": True,
            "commands": False,
            "commands_reason": NO_COMMANDS,
        }
        self.status: Counter[str] = Counter()  # lines, steps, unreadable, ... (docs/watch.md)
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self._next_seq = 0
        self._next_kv_seq = 0
        self._log_now: float | None = None  # the latest log time: the engine's clock, as logged
        self._next_step = 0
        self._steps: deque[Message] = deque(maxlen=history_steps)
        self._kv: deque[Message] = deque(maxlen=history_steps)
        self._last_seq = -1  # the last seq the history has seen (server thread)
        self.delivered = 0  # messages handed to clients and sinks so far (and in the history)
        self._sinks: list[Sink] = [self._remember]
        self._publisher: Publisher | None = None

    # ---- producing side (any thread) ----

    def now(self) -> float:
        """Seconds since the watch started: the clock of `received` times."""
        return self._clock() - self._t0

    def step(self, facts: AggregateStep) -> Message:
        with self._lock:
            msg = {"type": "step", "step": self._next_step, **facts.fields()}
            if facts.t_source in ("log", "estimated"):  # the engine's own clock
                self._log_now = max(self._log_now or facts.t1, facts.t1)
            self._next_step += 1
            self.status["steps"] += 1
            return self._emit(msg)

    def broadcast(self, msg: Message) -> Message:
        """Number and send a message of another type (`kv_events`)."""
        with self._lock:
            return self._emit(msg)

    def _emit(self, msg: Message) -> Message:
        # v1.1 numbers the protocol's broadcasts; the publisher may number them too, and then
        # gets the same numbers (same messages, same order). `kv_events` (an extension) have
        # their own counter, so a client can still see when it missed some.
        if msg["type"] in SEQ_TYPES:
            msg["seq"] = self._next_seq
            self._next_seq += 1
        else:
            msg["kv_seq"] = self._next_kv_seq
            self._next_kv_seq += 1
        if self._publisher is not None:
            self._publisher.publish([msg])
        else:
            text = json.dumps(msg)
            for sink in self._sinks:
                sink(msg, text)
        return msg

    # ---- serving ----

    def add_trace(self, writer: TraceWriter) -> None:
        """Before `serve()`: record every message; as the engine server does, a `hello` comes
        first, written just before the first message so that it holds what the log's start-up
        lines said (model, pool size, chunk size)."""
        started = False

        def sink(msg: Message, text: str) -> None:
            nonlocal started
            if not started:
                started = True
                writer.write(json.dumps(self.hello()))
            writer.write(text)

        self._sinks.insert(0, sink)  # before the history sees the message: the header is empty

    def serve(self, config: PublisherConfig) -> Publisher:
        publisher = Publisher(config, hello=self.hello, sinks=self._sinks)
        publisher.on_frame = self._on_frame
        publisher.start()
        self._publisher = publisher
        return publisher

    def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.stop()

    def _remember(self, msg: Message, text: str) -> None:
        self.delivered += 1
        self._last_seq = msg.get("seq", self._last_seq)
        kind = msg.get("type")
        if kind == "step":
            self._steps.append(msg)
        elif kind == "kv_events":
            self._kv.append(msg)

    def hello(self) -> Message:
        return {
            "type": "hello",
            "protocol": PROTOCOL_VERSION,
            "protocol_minor": 1,  # v1.1: seq, hello.seq, hello.engine.instance
            "seq": self._last_seq,
            "now": self._log_now if self._log_now is not None else self.now(),
            "engine": {**self.engine, "watch": dict(self.status)},
            "config": {},
            "history": {"steps": list(self._steps), "requests": [], "kv_events": list(self._kv)},
        }

    async def _on_frame(self, client: Any, frame: str | bytes) -> None:
        """Commands get a clear refusal; `stats` gets the watch's counters."""
        assert self._publisher is not None
        try:
            cmd = json.loads(frame)
        except ValueError:
            self._publisher.reply(client, messages.error(None, "invalid_json", "not JSON"))
            return
        if not isinstance(cmd, dict):
            self._publisher.reply(client, messages.error(None, "invalid_json", "not an object"))
            return
        cid = cmd.get("id") if isinstance(cmd.get("id"), str) else None
        if cmd.get("type") == "stats":
            self._publisher.reply(client, messages.stats(cid, self.now(), dict(self.status)))
        else:
            self._publisher.reply(client, messages.error(cid, "unknown_type", NO_COMMANDS))

    def summary_line(self) -> str:
        """The final stderr line: what was read, produced and could not be read."""
        parts = [f"{k} {v}" for k, v in sorted(self.status.items())]
        return "watch: " + (", ".join(parts) if parts else "nothing read")
