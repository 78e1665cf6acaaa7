"""The WebSocket publisher: an asyncio server that fans messages out to clients, in its own
thread or on a loop it is given (the API process serves everything on one loop).

The engine thread hands over whole batches of messages with `publish()`, which never waits. The
server thread numbers each broadcast (`seq`, protocol v1.1), serializes it once, gives it to the
sinks (the history fold, trace file) and appends the same string to every client's bounded
queue. `publish_serialized()` takes batches already numbered and serialized elsewhere (the
engine's own process) and only parses them for the sinks. Either way each request's end event
(`finished`, `aborted`) gets its `delay` here (instrumentation.delay), before any sink or client
sees it: the only re-serialized messages. A client that stops reading loses its oldest messages;
once it has lost `drop_limit` of them without catching up, it is disconnected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from ipaddress import ip_address
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, broadcast, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.protocol import State

from instrumentation.delay import DelayLedger
from instrumentation.protocol import BROADCAST_TYPES

log = logging.getLogger("stepscope.publisher")

Message = dict[str, Any]


class Record(Protocol):
    """An engine record (instrumentation.records): its `to_dict()` is the protocol message."""

    def to_dict(self) -> Message: ...


Sink = Callable[[Message, str], None]
LOCAL_HOSTS = frozenset(("localhost", "127.0.0.1", "::1"))
CLOSE_TOO_SLOW = 1008  # policy violation: the client did not read its messages
WRITE_LIMIT = 2**16  # bytes in a connection's write buffer beyond which messages wait in its outbox


def running_on(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether the caller runs on `loop`: then work for it needs no hop from another thread (the
    API process serves the engine's events, WebSocket clients and HTTP on one loop)."""
    try:
        return loop is not None and asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    allowed_origins: tuple[str, ...] = ()  # beyond localhost origins, which are always allowed
    max_frame_bytes: int = 2**20
    client_queue: int = 4096  # messages held per client before the oldest are dropped
    drop_limit: int = 16384  # drops without catching up before the client is disconnected
    # the kernel's send buffer per client in bytes; None: the OS's, which grows to megabytes
    # (Linux: tcp_wmem), all of it delivered late to a client that lags instead of dropped
    socket_buffer: int | None = None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, extra: Sequence[str]) -> bool:
    """No Origin header means a non-browser client; browsers must come from localhost or `extra`."""
    if origin is None:
        return True
    if origin in extra:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and (parts.hostname or "") in LOCAL_HOSTS


def token_presented(request: Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth.removeprefix("Bearer ").strip()
    values = parse_qs(urlsplit(request.path).query).get("token")
    return values[0] if values else None


class Client:
    """One connection's bounded outbox; only the server thread touches it.

    While the outbox is empty and the socket keeps up, messages are written straight to the
    connection; otherwise they wait in the outbox, whose oldest entries go first when it is full.
    """

    def __init__(self, ws: ServerConnection, capacity: int) -> None:
        self.ws = ws
        self.outbox: deque[str] = deque()
        self.ready = asyncio.Event()
        self.capacity = capacity
        self.dropped_total = 0
        self.dropped_behind = 0  # drops since the outbox was last empty

    def can_write_now(self) -> bool:
        return not self.outbox and self.ws.transport.get_write_buffer_size() <= WRITE_LIMIT

    def push(self, text: str) -> None:
        if len(self.outbox) >= self.capacity:
            self.outbox.popleft()
            self.dropped_total += 1
            self.dropped_behind += 1
        self.outbox.append(text)
        self.ready.set()


class Publisher:
    """Start with `start()`; then `publish()` from any thread and `stop()` at the end."""

    def __init__(
        self,
        config: PublisherConfig,
        *,
        hello: Callable[[], Message],
        sinks: Iterable[Sink] = (),
        loads: Callable[[bytes], Message] = json.loads,
        delays: bool = True,
    ) -> None:
        self.config = config
        # names each request's delay in its end event, before any sink or client sees it
        # (instrumentation.delay): the one place that sees the whole stream from the start
        self.delays = DelayLedger() if delays else None
        self._hello = hello
        self._loads = loads  # parses what `publish_serialized` is given
        # Set before start(): handles each frame a client sends (the command handler).
        self.on_frame: Callable[[Client, str | bytes], Awaitable[None]] = _ignore_frame
        self._sinks = list(sinks)
        self.clients: set[Client] = set()
        self.port: int = config.port
        self.messages_published = 0
        self.seq = -1  # the `seq` of the last broadcast; the first one is 0
        self.dropped_total = 0
        self.slow_disconnects = 0
        self._thread: threading.Thread | None = None
        self._served: concurrent.futures.Future | None = None  # serving on a shared loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"ws://{host}:{self.port}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "publisher not started"
        return self._loop

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Bind and serve in a daemon thread, or on `loop` (another thread's running loop) when
        given; raises the bind error (e.g. port in use)."""
        if loop is not None:
            # no thread of its own: what reaches it on `loop` is handled in the same turn
            self._served = asyncio.run_coroutine_threadsafe(self._serve_reporting(), loop)
        else:
            self._thread = threading.Thread(target=self._run, name="stepscope-ws", daemon=True)
            self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            if self._thread is not None:
                self._thread.join()
            raise self._start_error

    def stop(self) -> None:
        """Close every connection and release the port; safe to call more than once."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop already finished
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self._served is not None:
            with contextlib.suppress(Exception):  # its failure was logged; a timeout: give up
                self._served.result(timeout=15)

    def publish(self, messages: list[Message | Record]) -> None:
        """Thread-safe, never blocks: hand a batch to the server thread in engine order.

        Records are turned into dicts on the server thread, keeping that work off the engine's.
        """
        if messages and self._loop is not None:
            if running_on(self._loop):
                self._fan_out(messages)
                return
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                self._loop.call_soon_threadsafe(self._fan_out, messages)

    def publish_serialized(self, frames: list[bytes]) -> None:
        """Thread-safe, never blocks: a batch already numbered and serialized (JSON bytes, by
        the engine's process). Each is parsed once for the sinks; its bytes go to clients as
        they are."""
        if frames and self._loop is not None:
            if running_on(self._loop):  # a shared loop: no hop to another thread
                self._fan_out_serialized(frames)
                return
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                self._loop.call_soon_threadsafe(self._fan_out_serialized, frames)

    def broadcast(self, message: Message) -> None:
        """Server thread only: send to every client, in order with what `publish` sent."""
        self._fan_out([message])

    def reply(self, client: Client, message: Message) -> None:
        """Server thread only: send to one client, in order with everything else it gets."""
        _deliver([client], [json.dumps(message)])

    def counters(self) -> dict[str, int]:
        """Server thread only: connection and delivery counters for the `stats` reply."""
        return {
            "clients": len(self.clients),
            "messages_published": self.messages_published,
            "seq": self.seq,
            "dropped": self.dropped_total + sum(c.dropped_total for c in self.clients),
            "slow_disconnects": self.slow_disconnects,
        }

    def _fan_out(self, messages: list[Message | Record]) -> None:
        texts = []
        for item in messages:
            msg = item if isinstance(item, dict) else item.to_dict()
            if msg.get("type") in BROADCAST_TYPES:
                self.seq += 1
                msg["seq"] = self.seq
            if self.delays is not None:
                self.delays.annotate(msg)
            text = json.dumps(msg)  # once, shared by every client
            for sink in self._sinks:
                sink(msg, text)
            texts.append(text)
        self._deliver(texts)

    def _fan_out_serialized(self, frames: list[bytes]) -> None:
        texts = []
        payloads = frames
        for i, frame in enumerate(frames):
            msg = self._loads(frame)
            if isinstance(seq := msg.get("seq"), int):
                self.seq = seq
            if self.delays is not None and self.delays.annotate(msg):  # a request's end
                text = json.dumps(msg)
                if payloads is frames:
                    payloads = list(frames)
                payloads[i] = text.encode()
            else:
                text = frame.decode()
            for sink in self._sinks:
                sink(msg, text)
            texts.append(text)
        self._deliver(texts, payloads)

    def _deliver(self, texts: list[str], payloads: list[bytes] | None = None) -> None:
        _deliver(self.clients, texts, payloads)
        self.messages_published += len(texts)
        for client in [c for c in self.clients if c.dropped_behind > self.config.drop_limit]:
            self._disconnect_slow(client)

    def _disconnect_slow(self, client: Client) -> None:
        self.clients.discard(client)
        self.slow_disconnects += 1
        self.dropped_total += client.dropped_total
        log.warning("disconnecting a client that stopped reading")
        self.loop.create_task(_close_or_abort(client.ws, CLOSE_TOO_SLOW, "client too slow"))

    def _run(self) -> None:
        asyncio.run(self._serve_reporting())

    async def _serve_reporting(self) -> None:
        try:
            await self._serve()
        except BaseException as exc:  # reported to start(); a failure after start is logged
            if not self._ready.is_set():
                self._start_error = exc
                self._ready.set()
            else:
                log.exception("publisher failed")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server: Server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._check_request,
            max_size=self.config.max_frame_bytes,
            compression=None,  # per-connection deflate would undo "serialize once"
            write_limit=WRITE_LIMIT,
            close_timeout=2,
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        server.close()
        await server.wait_closed()

    def _check_request(self, conn: ServerConnection, request: Request) -> Response | None:
        token = self.config.token
        if token is not None:
            presented = token_presented(request)
            if presented is None or not hmac.compare_digest(presented, token):
                return _respond(conn, HTTPStatus.UNAUTHORIZED, "a valid token is required\n")
        if not origin_allowed(request.headers.get("Origin"), self.config.allowed_origins):
            return _respond(conn, HTTPStatus.FORBIDDEN, "origin not allowed\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        if self.config.socket_buffer is not None:  # before anything but the handshake is sent
            sock = ws.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_buffer)
        client = Client(ws, self.config.client_queue)
        # No await between writing hello and joining the fan-out: nothing is missed or doubled.
        # Hello goes straight to the socket buffer, so a full outbox can never drop it.
        broadcast([ws], json.dumps(self._hello()))
        self.clients.add(client)
        sender = asyncio.create_task(self._send_loop(client))
        try:
            async for frame in ws:
                try:
                    await self.on_frame(client, frame)
                except Exception:  # a bug in one command must not close the connection
                    log.exception("command handler failed")
        except ConnectionClosed:
            pass
        finally:
            sender.cancel()
            if client in self.clients:
                self.clients.discard(client)
                self.dropped_total += client.dropped_total

    async def _send_loop(self, client: Client) -> None:
        """Drains the outbox, waiting for the socket whenever its buffer is full."""
        ws = client.ws
        try:
            while True:
                while not client.outbox:
                    client.dropped_behind = 0
                    client.ready.clear()
                    await client.ready.wait()
                await ws.send(client.outbox.popleft())
        except ConnectionClosed:
            pass


def _deliver(
    clients: Iterable[Client], texts: list[str], payloads: list[bytes] | None = None
) -> None:
    """Write a batch to every client that keeps up, queue it for the others; never waits.
    `payloads`: the texts' UTF-8 bytes, when the caller has them."""
    for client in clients:
        if not client.can_write_now():
            for text in texts:
                client.push(text)
            continue
        payloads = payloads or [t.encode() for t in texts]
        _write_frames(client.ws, payloads)


def _write_frames(ws: ServerConnection, payloads: list[bytes]) -> None:
    """One socket write for a whole batch of text frames (as `broadcast` does for one message).

    A write per message costs a system call and a wake-up of the reader each time, which on a
    CPU engine is most of what publishing costs.
    """
    protocol = ws.protocol
    if protocol.state is not State.OPEN:  # closing: its handler is about to finish
        return
    try:
        for payload in payloads:
            protocol.send_text(payload)
        ws.transport.write(b"".join(protocol.data_to_send()))
    except Exception:  # as `broadcast` does: a failing connection is closed by its handler
        log.warning("could not write to a client", exc_info=True)


async def _ignore_frame(client: Client, frame: str | bytes) -> None:
    return None


def _respond(conn: ServerConnection, status: HTTPStatus, text: str) -> Response:
    response = conn.respond(status, text)
    if status == HTTPStatus.UNAUTHORIZED:
        response.headers["WWW-Authenticate"] = 'Bearer realm="stepscope"'
    return response


async def _close_or_abort(ws: ServerConnection, code: int, reason: str) -> None:
    """A client that reads nothing never takes the close frame: give up on it after a moment."""
    try:
        await asyncio.wait_for(ws.close(code, reason), timeout=2)
    except (TimeoutError, ConnectionClosed, OSError):
        ws.transport.abort()
