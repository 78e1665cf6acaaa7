"""The engine process's end of the wire (ipc.py), and the API process it spawns.

`EngineBridge.publish` runs on the engine thread: it serializes each flushed batch of events once
and sends it as one frame, the only per-token work left in this process. The calls of the API
process (submit, abort, set_config, the reads) are answered on the bridge's own thread: commands
go through `LLM`'s thread-safe methods, and reads that need a quiet engine run between two steps
through `EngineLoop.call`. `ApiProcess` starts `python -m engine.server.frontend` with the
server's settings on its stdin and stops it after the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from engine.server.ipc import END, EventEncoder, decode, encode_reply, endpoints
from engine.server.loop import EngineLoop
from instrumentation import messages
from instrumentation.errors import Capacity, EngineError

log = logging.getLogger("stepscope.server")
STOP_TIMEOUT_S = 15.0


class EngineBridge:
    """Bind with the engine's facts; `attach` the engine loop, then `start` answering calls."""

    def __init__(self, llm: Any, directory: str | Path, facts: dict[str, Any], max_waiting: int):
        self.llm = llm
        self.facts = facts  # what the API process asks for first (client.EngineFacts)
        self.max_waiting = max_waiting
        self.calls_addr, events_addr = endpoints(directory)
        self._ctx = zmq.Context()
        self._events = self._ctx.socket(zmq.PUSH)
        self._events.setsockopt(zmq.SNDHWM, 0)  # never drop an event; the API process drains
        self._events.setsockopt(zmq.LINGER, 2000)  # the last batches still go out at close
        self._events.bind(events_addr)
        self._encoder = EventEncoder()
        self.loop: EngineLoop | None = None
        self.ready = threading.Event()  # the API process serves: `urls` holds its addresses
        self.urls: dict[str, str | None] = {}
        self._thread: threading.Thread | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._bound = threading.Event()

    # -- events (engine thread) ---------------------------------------------------------------
    def publish(self, batch: list[Any]) -> None:
        """One frame per batch: the messages' JSON, one per line (JSON never holds a raw newline)."""
        frame = b"\n".join(self._encoder.encode(batch))
        try:
            self._events.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:  # no API process connected (it died): nobody to tell
            log.warning("no API process to take %d events", len(batch))

    def end(self) -> None:
        """The last frame: the engine stopped (after the loop's final flush, same thread)."""
        with contextlib.suppress(zmq.Again):
            self._events.send(END, flags=zmq.NOBLOCK)

    # -- calls (the bridge's thread) ----------------------------------------------------------
    def attach(self, loop: EngineLoop) -> EngineBridge:
        self.loop = loop
        return self

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepscope-bridge", daemon=True)
        self._thread.start()
        self._bound.wait()

    def close(self) -> None:
        if self._aloop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._aloop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)
        self._events.close()
        self._ctx.term()

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        sock = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.calls_addr)
        self._bound.set()
        tasks: set[asyncio.Task] = set()
        receiver = asyncio.ensure_future(self._receive(sock, tasks))
        await self._stop.wait()
        receiver.cancel()
        for t in tasks:
            t.cancel()
        sock.close()

    async def _receive(self, sock: zmq.asyncio.Socket, tasks: set[asyncio.Task]) -> None:
        while True:
            ident, frame = await sock.recv_multipart()
            task = asyncio.ensure_future(self._answer(sock, ident, frame))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _answer(self, sock: zmq.asyncio.Socket, ident: bytes, frame: bytes) -> None:
        call_id, method, kwargs = decode(frame)
        try:
            value = self._methods()[method](**kwargs)
            if asyncio.iscoroutine(value):
                value = await value
            ok = True
        except Exception as exc:
            if not isinstance(exc, EngineError):  # a bug, not bad input: say so here too
                log.exception("call %r failed", method)
            ok, value = False, exc
        if call_id is not None:
            await sock.send_multipart([ident, encode_reply(call_id, ok, value)])

    def _methods(self) -> dict[str, Callable[..., Any]]:
        return {
            "facts": lambda: self.facts,
            "ready": self._ready,
            "submit": self._submit,
            "abort": self._abort,
            "set_config": self._set_config,
            "read": self._read,
            "stats": self._stats,
        }

    def _ready(self, **urls: str | None) -> None:
        self.urls = urls
        self.ready.set()

    def _submit(self, requests: list[tuple[list[int], Any]], source: str | None) -> list[int]:
        """All or none: the capacity and every request's size first, then each is queued."""
        llm = self.llm
        if llm.num_waiting() + len(requests) > self.max_waiting:
            raise Capacity(f"{self.max_waiting} requests are already waiting; try later")
        for ids, params in requests:
            llm.check_fits(len(ids), params.max_tokens)
        uids: list[int] = []
        try:
            for ids, params in requests:
                uids.append(llm.submit(ids, params, source=source))
        except EngineError:
            for uid in uids:
                with contextlib.suppress(EngineError):
                    llm.abort(uid)
            raise
        finally:
            self._wake()
        return uids

    def _abort(self, uid: int) -> None:
        try:
            self.llm.abort(uid)
        finally:
            self._wake()

    def _set_config(self, command_id: str | None = None, **values: Any) -> dict[str, Any]:
        """Applied from the next step; every client hears it as a `config` broadcast, in order
        with the events (it goes out with the next flush)."""
        assert self.loop is not None
        live = self.llm.set_config(**values)
        self.loop.post(messages.config(command_id, self.llm.now(), live))
        return live

    async def _read(self, name: str) -> Any:
        """A read between two steps, on the engine thread: the pool and queues hold still."""
        assert self.loop is not None
        return await asyncio.wrap_future(self.loop.call(lambda: READS[name](self.llm)))

    async def _stats(self) -> dict[str, Any]:
        assert self.loop is not None
        values = await asyncio.wrap_future(self.loop.call(self._engine_stats))
        if (snapshot := values.pop("snapshot")) is not None:  # page by page, off the engine
            values["integrity"] = await asyncio.to_thread(snapshot.verdict)
        return values

    def _engine_stats(self) -> dict[str, Any]:
        """Engine thread, between steps: the counters are checked (O(rows)) and the page
        accounting copied; `_stats` checks the copy page by page on another thread."""
        assert self.loop is not None
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

    def _wake(self) -> None:
        if self.loop is not None:
            self.loop.wake.set()


def _load(llm: Any) -> dict[str, Any]:
    """SGLang's load report: running and waiting requests, KV tokens in use."""
    q, kv = llm.queue_stats(), llm.kv_stats()
    return {"dp_rank": 0, "num_reqs": q.running + q.waiting, "num_waiting_reqs": q.waiting,
            "num_tokens": kv.used * llm.info.page_size}  # fmt: skip


def _flush_cache(llm: Any) -> int | None:
    """As SGLang: never under running or waiting requests (None then); else the pages freed."""
    if llm.num_waiting() or llm.queue_stats().running:
        return None
    return llm.flush_cache()


READS: dict[str, Callable[[Any], Any]] = {
    "kv_stats": lambda llm: llm.kv_stats(),
    "queue_stats": lambda llm: llm.queue_stats(),
    "config": lambda llm: llm.config_dict(),
    "kv_map": lambda llm: llm.kv_map(),
    "load": _load,
    "flush_cache": _flush_cache,
}


class ApiProcess:
    """`python -m engine.server.frontend` in a session of its own (a terminal's Ctrl-C reaches
    the engine process, which stops it in order), its settings written to its stdin."""

    def __init__(self, settings: dict[str, Any]) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the directory holding `engine`
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.server.frontend"], stdin=subprocess.PIPE,
            start_new_session=True, env=env,
        )  # fmt: skip
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: `exited()` says so
            self.proc.stdin.write(json.dumps({**settings, "parent_pid": os.getpid()}).encode())
            self.proc.stdin.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def wait_ready(self, bridge: EngineBridge) -> bool:
        """Until the API process serves (True) or exits (False, e.g. a port already taken)."""
        while not bridge.ready.wait(0.1):
            if self.proc.poll() is not None:
                return False
        return True

    def stop(self, timeout: float = STOP_TIMEOUT_S, graceful: bool = True) -> int:
        """Wait for it to end after the engine's END (`graceful`); terminate, then kill, if it
        does not."""
        actions = (None, self.proc.terminate, self.proc.kill)
        for action in actions if graceful else actions[1:]:
            if action is not None:
                with contextlib.suppress(ProcessLookupError):
                    action()
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("the API process did not stop in %.0f s", timeout)
        return self.proc.wait()
