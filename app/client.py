"""The engine connection: one background thread that keeps a WebSocket to the engine open.

It folds every server message into an `EventStore` and sends commands for any thread. Browser
tabs never talk to the engine themselves; they all read the one store this link feeds, so a
page with ten tabs is still one protocol client. On reconnect the server's `hello` (with its
history) is folded in like any other message, which redraws the past. When the store finds a
gap in `seq` (the server dropped messages while this client was slow), the link reconnects at
once: the new `hello` fills in what was missed, and the store counts the loss.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from app.state import EventStore, Message

MAX_FRAME = 64 * 2**20  # a hello with 2,000 steps of history is larger than one default frame


class NotConnected(RuntimeError):
    """A command was sent while no engine is connected."""


@dataclass(frozen=True)
class LinkStatus:
    url: str
    state: str  # "connecting" | "connected" | "unreachable" | "closed"
    error: str | None
    ever_connected: bool
    failed_attempts: int
    since: float  # time.monotonic() of the last state change


def valid_url(url: str) -> str | None:
    """Why `url` cannot be an engine address, or None if it can."""
    if not url.startswith(("ws://", "wss://")):
        return "The engine URL must start with ws:// or wss:// (for example ws://127.0.0.1:8765)."
    if len(url.split("://", 1)[1].strip("/")) == 0:
        return "The engine URL has no host."
    return None


class EngineLink:
    """`start()` once, `send()` from anywhere, `close()` when the page's resource is released."""

    def __init__(self, url: str, store: EventStore | None = None, retry_s: float = 1.0) -> None:
        self.url = url
        self.store = store or EventStore()
        self.retry_s = retry_s
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:6]
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ws: ClientConnection | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._status = LinkStatus(url, "connecting", None, False, 0, time.monotonic())
        self.resyncs = 0  # reconnections made to fill a gap in the message stream
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run()), name=f"stepscope-link {url}", daemon=True
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> EngineLink:
        self._thread.start()
        self._started.wait(5)
        return self

    def close(self) -> None:
        loop, stop = self._loop, self._stop

        def shutdown() -> None:
            if stop is not None:
                stop.set()
            if self._ws is not None:
                asyncio.ensure_future(self._ws.close())

        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(shutdown)
        self._thread.join(5)
        self._set_status("closed", None)

    def status(self) -> LinkStatus:
        with self._lock:
            return self._status

    def _set_status(self, state: str, error: str | None) -> None:
        with self._lock:
            old = self._status
            ever = old.ever_connected or state == "connected"
            failed = 0 if state == "connected" else old.failed_attempts + (state == "unreachable")
            self._status = LinkStatus(self.url, state, error, ever, failed, time.monotonic())

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        while not self._stop.is_set():
            resync = False
            try:
                async with connect(self.url, max_size=MAX_FRAME, open_timeout=5) as ws:
                    self._ws = ws
                    self._set_status("connected", None)
                    resync = await self._read(ws)
                if resync:
                    self.resyncs += 1
                    continue  # at once: the next hello fills the gap
                self._set_status("unreachable", "The engine closed the connection.")
            except InvalidURI as exc:
                self._set_status("unreachable", f"Not a WebSocket URL: {exc}")
            except (OSError, InvalidHandshake, TimeoutError, ConnectionClosed) as exc:
                self._set_status("unreachable", _describe(exc))
            finally:
                self._ws = None
            try:
                await asyncio.wait_for(self._stop.wait(), self.retry_s)
            except TimeoutError:
                pass

    async def _read(self, ws: ClientConnection) -> bool:
        """Fold messages until the connection ends; True if it was closed to resync."""
        async for raw in ws:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if isinstance(msg, dict) and self.store.apply(msg):
                await ws.close()  # messages were lost: reconnect for a fresh hello
                return True
        return False

    # ---- commands ----------------------------------------------------------------------------

    def new_id(self) -> str:
        return f"ui-{self._prefix}-{next(self._ids)}"

    def send(self, command: Message) -> str:
        """Send one command (an `id` is added if missing); returns its id."""
        command = dict(command)
        command.setdefault("id", self.new_id())
        ws, loop = self._ws, self._loop
        if ws is None or loop is None:
            raise NotConnected(f"not connected to the engine at {self.url}")
        future = asyncio.run_coroutine_threadsafe(ws.send(json.dumps(command)), loop)
        try:
            future.result(timeout=5)
        except (ConnectionClosed, TimeoutError) as exc:
            raise NotConnected(f"the connection to {self.url} dropped: {exc}") from exc
        return str(command["id"])

    def request(self, command: Message, timeout: float = 3.0) -> Message | None:
        """Send and wait for the reply that echoes the id (`accepted`, `config` or `error`)."""
        cid = self.send(command)
        return self.store.wait_reply(cid, timeout)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "Nothing is listening there (connection refused)."
    if isinstance(exc, TimeoutError):
        return "No answer within 5 s."
    if isinstance(exc, InvalidHandshake):
        return f"Something answers there, but not as a WebSocket engine: {exc}"
    return f"{type(exc).__name__}: {exc}"
