"""A ZMQ SUB loop: receive multipart messages from an engine's PUB socket until told to stop.

SGLang and vLLM bind their PUB sockets (`tcp://*:PORT`) and subscribers connect; with `bind`
the watch binds instead, for an engine told to connect. pyzmq is imported here only, so the log
sources run without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

POLL_MS = 100

Frames = list[bytes]


def subscribe(
    endpoint: str,
    handle: Callable[[Frames], None],
    stop: threading.Event,
    *,
    bind: bool = False,
    ready: threading.Event | None = None,
) -> None:
    """Call `handle` with each message's frames; returns once `stop` is set."""
    try:
        import zmq
    except ImportError as exc:  # the optional `watch` extra
        raise SystemExit(
            "watching a ZMQ endpoint needs pyzmq and msgpack: pip install -e '.[watch]'"
        ) from exc
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        if ready is not None:
            ready.set()
        while not stop.is_set():
            if sock.poll(POLL_MS):
                handle(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def envelope(frames: Frames) -> tuple[int | None, bytes]:
    """(sequence number, payload) of `(topic, seq 8 bytes big-endian, payload)`, the framing
    both engines use; a bare payload has no sequence number."""
    payload = frames[-1]
    if len(frames) >= 2 and len(frames[-2]) == 8:
        return int.from_bytes(frames[-2], "big", signed=True), payload
    return None, payload
