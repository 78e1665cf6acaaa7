"""The engine loop and the WebSocket commands: the engine thread steps `LLM` while there is
work and hands each step's events to the publisher; `CommandHandler` turns a client's frame into
an engine call on the server thread. Commands reach the engine through `LLM`'s thread-safe
methods, and events come back through an event hook that only appends to a list.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from engine.config import POLICY_NAMES
from instrumentation import messages
from instrumentation.commands import (
    Abort,
    CommandError,
    KVMap,
    SetConfig,
    Stats,
    Submit,
    parse_command,
)
from instrumentation.errors import EngineError
from instrumentation.publisher import Client, Publisher

log = logging.getLogger("stepscope.server")

# Events are handed to the server thread at most this often (and whenever the engine idles):
# each hand-over wakes that thread, which then holds the GIL the engine needs, so a fast engine
# (milliseconds per step) should pay for it once per few steps, not every step.
FLUSH_INTERVAL_S = 0.01
# While the server thread serializes a batch of events it holds the GIL; the engine thread,
# back from launching a step, then waits until the interpreter switches threads: 5 ms by
# default, longer than a decode step on a GPU. A shorter interval bounds that wait.
GIL_SWITCH_INTERVAL_S = 0.0005


class EngineLoop:
    """Steps the engine while there is work; hands each step's events to the publisher."""

    def __init__(self, llm: Any, publish: Callable[[list[Any]], None]) -> None:
        self.llm = llm
        self.publish = publish
        self.wake = threading.Event()  # set by every command, so an idle loop never spins
        self.steps = 0
        self.errors = 0
        self._pending: list[Any] = []
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._stopping = False
        self._last_flush = 0.0
        # The whole event hook: no serializing or I/O on the engine thread (see `attach`).
        self.on_event: Callable[[Any], None] = self._pending.append

    def attach(self) -> EngineLoop:
        self.llm.add_event_hook(self.on_event)
        if hasattr(self.llm, "add_wait_hook"):
            # hand the events over while the engine waits for the device: the server thread
            # then serializes them in time the engine thread does not need
            self.llm.add_wait_hook(self.flush)
        return self

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps (for reads that need a quiet engine)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        self.wake.set()
        return future

    def stop(self) -> None:
        self._stopping = True
        self.wake.set()

    def run(self) -> None:
        """Until `stop()`; re-raises an engine failure after publishing what it produced."""
        try:
            while not self._stopping:
                self.wake.clear()  # before looking for work, so a later command is not missed
                self._run_calls()
                record = self.run_once()
                if record is None and not self.llm.in_flight:
                    self.flush()
                    self.wake.wait(timeout=0.05 if self.llm.has_work() else 0.5)
        finally:
            self.flush()
            self._fail_calls()

    def run_once(self) -> Any:
        try:
            record = self.llm.step()
        except Exception:
            self.errors += 1
            self.flush()
            raise
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()
        if record is not None:
            self.steps += 1
        return record

    def flush(self) -> None:
        """Hand the events collected so far to the publisher."""
        self._last_flush = time.monotonic()
        if self._pending:
            batch = self._pending.copy()
            self._pending.clear()  # the same list: `on_event` is its bound `append`
            self.publish(batch)

    def _run_calls(self) -> None:
        if not self._calls.empty():
            self.flush()  # a call's reply must not overtake the events before it
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)

    def _fail_calls(self) -> None:
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            future.cancel()


class CommandHandler:
    """Turns one client frame into an engine call and a reply (runs on the server thread)."""

    def __init__(self, llm: Any, loop: EngineLoop, publisher: Publisher, max_waiting: int) -> None:
        self.llm = llm
        self.loop = loop
        self.publisher = publisher
        self.max_waiting = max_waiting
        self.vocab_size: int = llm.info.vocab_size

    async def on_frame(self, client: Client, frame: str | bytes) -> None:
        try:
            cmd = parse_command(frame, vocab_size=self.vocab_size, policies=POLICY_NAMES)
        except CommandError as exc:
            self.publisher.reply(client, messages.error(exc.command_id, exc.code, exc.message))
            return
        try:
            if isinstance(cmd, Submit):
                await self._submit(client, cmd)
            elif isinstance(cmd, Abort):
                self.llm.abort(cmd.uid)
                self.loop.wake.set()
                # the sender hears at once; every client sees the `aborted` event that follows
                self.publisher.reply(client, messages.accepted(cmd.id, cmd.uid))
            elif isinstance(cmd, SetConfig):
                self._set_config(cmd)
            elif isinstance(cmd, Stats):
                await self._stats(client, cmd)
            elif isinstance(cmd, KVMap):
                await self._kv_map(client, cmd)
        except EngineError as exc:
            code = exc.code if exc.code in messages.ERROR_CODES else "invalid_request"
            self.publisher.reply(client, messages.error(cmd.id, code, str(exc)))  # type: ignore[arg-type]
        except Exception:  # a bug here must still answer, and must not reach the engine loop
            log.exception("command %r failed", type(cmd).__name__)
            reason = "the server could not carry out this command"
            self.publisher.reply(client, messages.error(cmd.id, "invalid_request", reason))

    async def _submit(self, client: Client, cmd: Submit) -> None:
        if self.llm.num_waiting() >= self.max_waiting:
            reason = f"{self.max_waiting} requests are already waiting; try later"
            self.publisher.reply(client, messages.error(cmd.id, "capacity", reason))
            return
        # Off the server thread: tokenizing a long prompt must not hold up other clients.
        uid = await asyncio.to_thread(self.llm.submit, cmd.prompt, cmd.params, chat=cmd.chat)
        self.loop.wake.set()
        self.publisher.reply(client, messages.accepted(cmd.id, uid))

    def _set_config(self, cmd: SetConfig) -> None:
        values = self.llm.set_config(
            max_extend_tokens=cmd.max_extend_tokens, policy=cmd.policy, admission=cmd.admission
        )
        self.loop.wake.set()
        self.publisher.broadcast(messages.config(cmd.id, self.llm.now(), values))

    async def _kv_map(self, client: Client, cmd: KVMap) -> None:
        # Between two steps, on the engine thread: the page table and the tree hold still.
        values = await asyncio.wrap_future(self.loop.call(self.llm.kv_map))
        self.publisher.reply(client, messages.kv_map(cmd.id, values.pop("t"), values))

    async def _stats(self, client: Client, cmd: Stats) -> None:
        values = await asyncio.wrap_future(self.loop.call(self._engine_stats))
        if (snapshot := values.pop("snapshot")) is not None:  # page by page, off the engine
            values["integrity"] = await asyncio.to_thread(snapshot.verdict)
        values.update(self.publisher.counters())
        self.publisher.reply(client, messages.stats(cmd.id, self.llm.now(), values))

    def _engine_stats(self) -> dict[str, Any]:
        """Engine thread, between steps: the counters are checked (O(rows)) and the page
        accounting copied; `_stats` checks the copy page by page on another thread."""
        try:
            snapshot, integrity = self.llm.integrity_snapshot(), "ok"
        except AssertionError as exc:
            snapshot, integrity = None, f"failed: {exc}"
        return {
            "steps": self.loop.steps,
            "engine_errors": self.loop.errors,
            "integrity": integrity,
            "snapshot": snapshot,
            "kv": asdict(self.llm.kv_stats()),
            "queue": asdict(self.llm.queue_stats()),
        }
