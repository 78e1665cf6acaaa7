"""Protocol v1.1: `seq` on every broadcast, gaps a slow client can see, the store's resync and
its loss report, restarts told by `hello.engine.instance`. (The abort acknowledgement is checked
against a real server in tests/server/test_server.py.)"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from app.client import EngineLink
from app.state import EventStore
from instrumentation import messages
from instrumentation.fold import Fold
from instrumentation.publisher import Publisher, PublisherConfig
from instrumentation.request_record import Gap
from tests.server.test_server_support import ProtoClient, stuck_client

Msg = dict[str, Any]


def _publisher(**overrides: Any) -> Publisher:
    fold = Fold()  # what the server's recorder does: fold every broadcast, say where it ends
    engine = {"model": "fake", "instance": "abc"}
    pub = Publisher(
        PublisherConfig(port=0, **overrides),
        hello=lambda: messages.hello(0.0, engine, {}, fold.history(), fold.seq),
        sinks=[lambda msg, _text: fold.apply(msg)],
    )
    pub.start()
    return pub


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = _publisher()
    yield pub
    pub.stop()


def test_seq_is_consecutive_and_the_same_for_every_client(publisher: Publisher) -> None:
    a = ProtoClient(publisher.url)
    assert a.hello["seq"] == -1 and a.hello["engine"]["instance"] == "abc"
    publisher.publish([{"type": "token", "uid": 0, "t": 0.0, "text": "x"} for _ in range(10)])
    for _ in range(10):
        a.recv()
    b_late = ProtoClient(publisher.url)  # joins after 10 broadcasts: its hello says so
    assert b_late.hello["seq"] == 9
    publisher.loop.call_soon_threadsafe(
        publisher.broadcast, messages.config("c", 1.0, {"policy": "mixed"})
    )
    publisher.publish(
        [{"type": "step", "step": k, "t0": 0, "t1": 1, "items": []} for k in range(5)]
    )
    got_a = [a.recv()["seq"] for _ in range(6)]
    got_b = [b_late.recv()["seq"] for _ in range(6)]
    assert got_a == got_b == list(range(10, 16))
    assert [m["seq"] for m in a.seen[1:11]] == list(range(10))  # after the hello
    a.close()
    b_late.close()


def _frames(sock: socket.socket, timeout: float) -> Iterator[str]:
    """Text frames from a raw WebSocket (server frames are unmasked), until the peer closes."""
    sock.settimeout(timeout)
    buf = b""

    def need(n: int) -> bool:
        nonlocal buf
        while len(buf) < n:
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                return False
            if not chunk:
                return False
            buf += chunk
        return True

    while need(2):
        opcode, n = buf[0] & 0x0F, buf[1] & 0x7F
        head = 2
        if n == 126:
            if not need(4):
                return
            n, head = int.from_bytes(buf[2:4], "big"), 4
        elif n == 127:
            if not need(10):
                return
            n, head = int.from_bytes(buf[2:10], "big"), 10
        if not need(head + n):
            return
        payload, buf = buf[head : head + n], buf[head + n :]
        if opcode == 1:
            yield payload.decode()
        elif opcode == 8:
            return


def test_a_client_that_fell_behind_sees_the_gap() -> None:
    pub = _publisher(client_queue=20, drop_limit=10**9)
    try:
        sock = stuck_client(pub.port)  # reads nothing for now: its queue overflows
        payload = "y" * 4000  # more than the socket buffers hold: the outbox must drop
        total = 4000
        for _ in range(0, total, 50):
            pub.publish([{"type": "token", "uid": 0, "t": 0.0, "text": payload} for _ in range(50)])
        deadline = time.monotonic() + 30
        while pub.counters()["dropped"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.counters()["dropped"] > 0, "nothing was dropped: the test proves nothing"
        fold, gaps = Fold(), []
        seqs = []
        for text in _frames(sock, timeout=2.0):
            msg = json.loads(text)
            if msg["type"] == "hello":
                fold.apply(msg)
                continue
            seqs.append(msg["seq"])
            if (gap := fold.apply(msg)) is not None:
                gaps.append(gap)
            if msg["seq"] == total - 1:
                break
        assert seqs[-1] == total - 1 and seqs == sorted(seqs)
        assert gaps and sum(g.lost for g in gaps) == total - len(seqs)
        assert fold.lost == total - len(seqs) == pub.counters()["dropped"]
        sock.close()
    finally:
        pub.stop()


def _wait(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_store_resyncs_after_a_gap_and_reports_the_loss(publisher: Publisher) -> None:
    link = EngineLink(publisher.url, retry_s=0.1).start()
    try:
        _wait(lambda: link.status().state == "connected")
        step = {"type": "step", "t0": 0.0, "t1": 0.1, "items": [], "phase": "decode"}
        publisher.publish([{**step, "step": 0}, {**step, "step": 1}])
        _wait(lambda: len(link.store.snapshot().steps) == 2)

        def skip_three() -> None:  # as if the server had dropped 3 messages for this client
            publisher.seq += 3

        publisher.loop.call_soon_threadsafe(skip_three)
        publisher.publish([{**step, "step": 5}])
        _wait(lambda: link.store.snapshot().resyncs == 1)
        snap = link.store.snapshot()
        assert snap.lost == 3 and link.resyncs == 1
        assert [s["step"] for s in snap.steps] == [0, 1, 5]  # the resync's hello has them all
        publisher.publish([{**step, "step": 6}])
        _wait(lambda: len(link.store.snapshot().steps) == 4)
        assert link.store.snapshot().lost == 3  # no new gap after the resync
        assert not link.store.needs_resync
    finally:
        link.close()


def _hello(instance: str | None, now: float, steps: list[Msg], seq: int) -> Msg:
    engine = {"model": "m"} if instance is None else {"model": "m", "instance": instance}
    return messages.hello(now, engine, {}, {"steps": steps, "requests": []}, seq)


def _step(n: int, t: float) -> Msg:
    return {"type": "step", "step": n, "t0": t, "t1": t + 0.1, "items": [], "seq": n}


def test_a_restart_with_a_later_clock_is_told_by_instance() -> None:
    store = EventStore()
    store.apply(_hello("one", 5.0, [], -1))
    for n in range(4):
        store.apply(_step(n, float(n)))
    cursor = store.delta(None).cursor
    # the new engine has been up longer than the old one was: its clock is later
    store.apply(_hello("two", 500.0, [_step(0, 400.0)], 0))
    snap = store.snapshot()
    assert [s["t0"] for s in snap.steps] == [400.0] and snap.restarts == 1
    d = store.delta(cursor)
    assert d.restarted and d.reset and d.instance == "two"
    # the same instance again (a plain reconnect) is no restart, and keeps older steps
    store.apply(_step(1, 401.0))
    store.apply(_hello("two", 600.0, [_step(1, 401.0)], 1))
    assert store.snapshot().restarts == 1 and len(store.snapshot().steps) == 2


def test_fold_gaps_and_duplicates() -> None:
    fold = Fold()
    fold.apply(_hello("x", 0.0, [], 3))
    assert fold.apply(_step(4, 0.0)) is None
    assert fold.apply(_step(4, 0.0)) is None and fold.num_steps == 1  # a duplicate is skipped
    assert fold.apply(_step(9, 1.0)) == Gap(5, 9) and fold.lost == 4
    assert fold.num_steps == 2
