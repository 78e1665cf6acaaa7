"""The engine loop: the engine thread steps `LLM` while there is work and hands each step's
events to the publisher (the bridge to the API process, bridge.py). Commands reach the engine
through `LLM`'s thread-safe methods, and events come back through an event hook that only appends
to a list.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stepscope.server")

# A CPU engine's events go out at most this often (one send per few fast steps: the send shares
# the cores with the steps) and whenever the engine idles. A GPU engine's go out every step: at
# its wait for the device, while the device computes (free), or after the step when the host
# was the slower side and never waited (on the H200 a 1-stream decode is such a step: flushed
# every 10 ms instead, its tokens reached clients ten at a time, ITL p99 10.9 ms at a 1 ms step).
FLUSH_INTERVAL_S = 0.01
# The bridge's thread (bridge.py) takes the GIL to answer a call; the engine thread, back from
# launching a step, then waits until the interpreter switches threads: 5 ms by default, longer
# than a decode step on a GPU. A shorter interval bounds that wait.
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
        self._posted: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()  # other threads'
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._stopping = False
        self._last_flush = 0.0
        device = getattr(llm, "device", None)
        self.flush_interval = 0.0 if getattr(device, "type", None) == "cuda" else FLUSH_INTERVAL_S
        # The whole event hook: events are serialized in batches by `flush` (see `attach`).
        self.on_event: Callable[[Any], None] = self._pending.append

    def attach(self) -> EngineLoop:
        self.llm.add_event_hook(self.on_event)
        if hasattr(self.llm, "add_wait_hook"):
            # serialize and send the events while the engine waits for the device: time the
            # engine thread does not need
            self.llm.add_wait_hook(self.flush)
        return self

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps (for reads that need a quiet engine)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        self.wake.set()
        return future

    def post(self, message: dict[str, Any]) -> None:
        """Any thread: publish `message` with the next flush, after the events before it."""
        self._posted.put(message)
        self.wake.set()

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
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()
        if record is not None:
            self.steps += 1
        return record

    def flush(self) -> None:
        """Hand the events collected so far to the publisher."""
        self._last_flush = time.monotonic()
        if self._pending or not self._posted.empty():
            batch = self._pending.copy()
            self._pending.clear()  # the same list: `on_event` is its bound `append`
            while not self._posted.empty():
                batch.append(self._posted.get_nowait())
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
