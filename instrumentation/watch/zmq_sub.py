"""A ZMQ SUB loop: receive multipart messages from an engine's PUB socket until told to stop,
and vLLM's replay socket, which resends missed batches.

SGLang and vLLM bind their PUB sockets (`tcp://*:PORT`) and subscribers connect; with `bind`
the watch binds instead, for an engine told to connect (vLLM connects when its endpoint names a
host, `tcp://host:PORT`). pyzmq is imported here only, so the log sources run without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

POLL_MS = 100
REPLAY_TIMEOUT_MS = 2000
END_SEQ = -1  # vLLM's end-of-replay marker

Frames = list[bytes]


def _zmq():  # noqa: ANN202 - the module, imported lazily
    try:
        import zmq
    except ImportError as exc:  # the optional `watch` extra
        raise SystemExit(
            "watching a ZMQ endpoint needs pyzmq and msgpack: pip install -e '.[watch]'"
        ) from exc
    return zmq


def subscribe(
    endpoint: str,
    handle: Callable[[Frames], None],
    stop: threading.Event,
    *,
    bind: bool = False,
    ready: threading.Event | None = None,
) -> None:
    """Call `handle` with each message's frames; returns once `stop` is set."""
    zmq = _zmq()
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


def replay(
    endpoint: str, start_seq: int, timeout_ms: int = REPLAY_TIMEOUT_MS
) -> list[Frames] | None:
    """The batches vLLM's replay socket (`replay_endpoint`, a ROUTER) still holds from
    `start_seq` on, as (topic, seq, payload) frames; None when it did not answer in time. vLLM
    keeps the last `buffer_steps` batches (10,000 by default)."""
    zmq = _zmq()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
        out: list[Frames] = []
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()[1:]  # the empty delimiter first
            if len(frames) >= 2 and int.from_bytes(frames[-2], "big", signed=True) == END_SEQ:
                return out
            out.append(frames)
        return None
    finally:
        sock.close(linger=0)


def envelope(frames: Frames) -> tuple[int | None, bytes]:
    """(sequence number, payload) of `(topic, seq 8 bytes big-endian, payload)`, the framing
    both engines use; a bare payload has no sequence number."""
    payload = frames[-1]
    if len(frames) >= 2 and len(frames[-2]) == 8:
        return int.from_bytes(frames[-2], "big", signed=True), payload
    return None, payload
