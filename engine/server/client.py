"""The API process's handle on the engine process (the other end of ipc.py).

`EngineClient` holds the engine's facts (its `EngineInfo`, the tokenizer, the clock) and makes
its calls; one I/O thread owns both sockets, so any thread or event loop may call. The event
stream goes to `on_events`, one batch of serialized messages per engine flush. The engine is
`gone` once it sent END (it stopped) or once the process that spawned this one died: every call
then fails at once with `EngineGone` instead of waiting for an answer that cannot come.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from engine.config import EngineInfo
from engine.prompts import check_fits, encode_prompt
from engine.server.ipc import CALL_TIMEOUT_S, END, decode, encode_call, endpoints, rebuild_error
from instrumentation.publisher import running_on

log = logging.getLogger("stepscope.http")
PARENT_POLL_S = 0.2


class EngineGone(Exception):
    """The engine process stopped or died: nothing can be submitted or read."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine process tells the API process once, when it is ready."""

    info: EngineInfo
    hello: dict[str, Any]  # the `engine` object of every `hello`
    config: dict[str, Any]  # the live settings at start
    clock_start: float  # time.monotonic() when the engine's clock read 0
    tokenizer: str  # the tokenizer's directory
    model_dir: str | None  # the model's directory (its generation_config.json), if local

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineFacts:
        return cls(**{**d, "info": EngineInfo(**d["info"])})


class EngineClient:
    """`start()`, then `connect()` (waits for the engine's facts); calls from any thread."""

    def __init__(self, directory: str, parent_pid: int | None = None) -> None:
        self.calls_addr, self.events_addr = endpoints(directory)
        self.parent_pid = parent_pid
        self.on_events: Callable[[list[bytes]], None] = lambda frames: None
        self.on_gone: Callable[[str, bool], None] = lambda reason, clean: None
        self.gone: str | None = None  # why, once the engine is gone
        self.last_event = 0.0  # time.monotonic() of the last event frame
        self.facts: EngineFacts | None = None
        self.tokenizer: Any = None  # loaded by the API process from facts.tokenizer
        self._pending: dict[int, tuple[concurrent.futures.Future, str]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._started = threading.Event()
        # The engine sends its events (END too) without waiting, and a bound PUSH socket with no
        # peer yet drops them: `connect()` returns once the event stream is connected too.
        self._events_connected = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="stepscope-engine", daemon=True)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The I/O thread's running loop (after `start()`): the API process serves on it too."""
        assert self._loop is not None, "not started"
        return self._loop

    @property
    def info(self) -> EngineInfo:
        assert self.facts is not None, "not connected"
        return self.facts.info

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> EngineClient:
        self._thread.start()
        self._started.wait()
        return self

    def connect(self, stop: threading.Event) -> EngineFacts | None:
        """The engine's facts, once it is ready (it may be loading a model for minutes); None
        if `stop` is set first. EngineGone if the engine process died meanwhile."""
        future = self.call_future("facts")
        answered = threading.Event()  # at once when the facts come, not at the next poll
        future.add_done_callback(lambda _: answered.set())
        for event in (answered, self._events_connected):
            while not event.wait(0.1):
                if stop.is_set():
                    return None
        self.facts = EngineFacts.from_dict(future.result())
        return self.facts

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5)

    # -- what the engine would answer here ----------------------------------------------------
    def now(self) -> float:
        """The engine's clock (CLOCK_MONOTONIC is one clock for every process of a machine)."""
        assert self.facts is not None
        return time.monotonic() - self.facts.clock_start

    def encode(self, prompt: Any, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.info.vocab_size, chat)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        info = self.info
        check_fits(prompt_len, max_tokens, max_seq_len=info.max_seq_len,
                   page_size=info.page_size, num_pages=info.num_pages)  # fmt: skip

    # -- calls --------------------------------------------------------------------------------
    def call_future(self, method: str, **kwargs: Any) -> concurrent.futures.Future:
        """Any thread: the call's future (its result, the engine's error, or EngineGone)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.gone is not None:
            future.set_exception(EngineGone(self.gone))
            return future
        call_id = next(self._ids)
        self._pending[call_id] = (future, method)
        if self.gone is not None and self._pending.pop(call_id, None) is not None:
            future.set_exception(EngineGone(self.gone))  # it went while this was registered
            return future
        self._post(encode_call(call_id, method, kwargs))
        return future

    async def call(self, method: str, timeout: float | None = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        """On any event loop: the call's result; TimeoutError after `timeout` seconds."""
        future = self.call_future(method, **kwargs)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def send(self, method: str, **kwargs: Any) -> None:
        """Any thread: a call whose answer nobody waits for (dropped once the engine is gone)."""
        if self.gone is None:
            self._post(encode_call(None, method, kwargs))

    def _post(self, frame: bytes) -> None:
        assert self._loop is not None, "not started"
        if running_on(self._loop):  # the HTTP and WebSocket handlers run here too: no hop
            self._send_now(frame)
            return
        with contextlib.suppress(RuntimeError):  # the I/O loop has closed: shutting down
            self._loop.call_soon_threadsafe(self._send_now, frame)

    def _send_now(self, frame: bytes) -> None:
        assert self._dealer is not None
        self._dealer.send(frame)

    # -- the I/O thread -----------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        ctx = zmq.asyncio.Context()
        self._dealer = ctx.socket(zmq.DEALER)
        events = ctx.socket(zmq.PULL)
        monitor = events.get_monitor_socket(zmq.EVENT_CONNECTED)
        for sock, addr in ((self._dealer, self.calls_addr), (events, self.events_addr)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)  # before the engine binds, too: ZMQ connects once it does
        self._started.set()
        watches = (self._replies(), self._events(events), self._watch_parent(),
                   self._watch_connected(events, monitor))  # fmt: skip
        tasks = [asyncio.ensure_future(c) for c in watches]
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        if not monitor.closed:  # stopped before the engine was up
            events.disable_monitor()
            monitor.close(linger=0)
        self._dealer.close()
        events.close()
        ctx.term()

    async def _replies(self) -> None:
        assert self._dealer is not None
        while True:
            call_id, ok, value = decode(await self._dealer.recv())
            entry = self._pending.pop(call_id, None)
            if entry is None:
                continue
            future, method = entry
            if not future.set_running_or_notify_cancel():
                if ok and method == "submit":  # its caller went away: nobody reads these
                    for uid in value:
                        self.send("abort", uid=uid)
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(rebuild_error(*value))

    async def _events(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            self.last_event = time.monotonic()
            if frame == END:
                self._end("the engine stopped", clean=True)
                return
            try:
                self.on_events(frame.split(b"\n"))
            except Exception:  # a bug in a sink must not stop the stream
                log.exception("event batch failed")

    async def _watch_connected(self, events: zmq.asyncio.Socket, monitor: Any) -> None:
        await monitor.recv_multipart()  # the one event it watches for: EVENT_CONNECTED
        events.disable_monitor()
        monitor.close(linger=0)
        self._events_connected.set()

    async def _watch_parent(self) -> None:
        if self.parent_pid is None:
            return
        while True:
            await asyncio.sleep(PARENT_POLL_S)
            if os.getppid() != self.parent_pid:  # reparented: the engine process died
                self._end("the engine process died", clean=False)
                return

    def _end(self, reason: str, clean: bool) -> None:
        if self.gone is not None:
            return
        self.gone = reason
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineGone(reason))
        self.on_gone(reason, clean)
