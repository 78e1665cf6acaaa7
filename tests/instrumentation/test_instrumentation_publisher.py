"""The publisher alone (no engine): ordered fan-out, slow clients, auth, origins, frame limit."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, InvalidStatus

from instrumentation import messages
from instrumentation.publisher import (
    Client,
    Publisher,
    PublisherConfig,
    is_loopback,
    origin_allowed,
)
from tests.server.test_server_support import ProtoClient, is_reset, stuck_client


def make_publisher(**overrides: Any) -> tuple[Publisher, list[str]]:
    sink: list[str] = []
    pub = Publisher(
        PublisherConfig(port=0, **overrides),
        hello=lambda: messages.hello(0.0, {"model": "fake"}, {}, {"steps": [], "requests": []}),
        sinks=[lambda _msg, text: sink.append(text)],
    )

    async def echo(client: Client, frame: str | bytes) -> None:
        pub.reply(client, messages.error(None, "unknown_type", f"echo {len(frame)}"))

    pub.on_frame = echo
    pub.start()
    return pub, sink


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub, _ = make_publisher()
    yield pub
    pub.stop()


def test_every_client_gets_hello_then_all_messages_in_order(publisher: Publisher) -> None:
    a, b = ProtoClient(publisher.url), ProtoClient(publisher.url)
    assert a.hello["engine"] == {"model": "fake"} and a.hello["protocol"] == 1
    for k in range(50):
        publisher.publish(
            [{"type": "token", "uid": 0, "n": k * 2}, {"type": "token", "uid": 0, "n": k * 2 + 1}]
        )
    for c in (a, b):
        got = [c.recv()["n"] for _ in range(100)]
        assert got == list(range(100))
        c.send("anything")
        assert c.recv()["message"] == "echo 8"  # replies go only to the sender
        c.close()


def test_sinks_see_each_message_once_serialized(publisher: Publisher) -> None:
    pub, sink = make_publisher()
    try:
        c = ProtoClient(pub.url)
        pub.publish([{"type": "step", "step": 1}])
        assert c.recv() == {"type": "step", "step": 1, "seq": 0}  # numbered once (v1.1)
        assert sink == [json.dumps({"type": "step", "step": 1, "seq": 0})]
        c.close()
    finally:
        pub.stop()


def test_a_stuck_client_is_dropped_while_others_get_everything() -> None:
    pub, _ = make_publisher(client_queue=50, drop_limit=100)
    try:
        reader = ProtoClient(pub.url)
        stuck = stuck_client(pub.port)
        payload = "x" * 10_000
        sent = 0
        while pub.slow_disconnects == 0 and sent < 20_000:
            pub.publish([{"type": "token", "n": sent + k, "text": payload} for k in range(20)])
            for k in range(20):  # paced by the reader, who must lose nothing
                assert reader.recv()["n"] == sent + k
            sent += 20
        assert pub.slow_disconnects == 1, "the stuck client was never disconnected"
        assert is_reset(stuck, timeout=30)
        counters = pub.counters()
        assert counters["clients"] == 1 and counters["dropped"] > 100
        reader.close()
    finally:
        pub.stop()


def test_oversized_frame_closes_with_1009(publisher: Publisher) -> None:
    c = ProtoClient(publisher.url)
    c.send("x" * (2**20 + 1))
    with pytest.raises(ConnectionClosedError) as info:
        c.recv(timeout=30)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    ok = ProtoClient(publisher.url)  # the server carries on
    ok.send("y")
    assert ok.recv()["type"] == "error"
    ok.close()


def test_token_required_when_configured() -> None:
    pub, _ = make_publisher(token="s3cret")
    try:
        for url, headers in [(pub.url, None), (pub.url + "/?token=wrong", None),
                             (pub.url, {"Authorization": "Bearer nope"})]:  # fmt: skip
            with pytest.raises(InvalidStatus) as info:
                ProtoClient(url, additional_headers=headers)
            assert info.value.response.status_code == 401
        ProtoClient(pub.url + "/?token=s3cret").close()
        ProtoClient(pub.url, additional_headers={"Authorization": "Bearer s3cret"}).close()
    finally:
        pub.stop()


def test_cross_site_browser_origins_are_refused(publisher: Publisher) -> None:
    with pytest.raises(InvalidStatus) as info:
        ProtoClient(publisher.url, origin="https://evil.example")
    assert info.value.response.status_code == 403
    for origin in ("http://localhost:8501", "http://127.0.0.1:8501", "http://[::1]:3000"):
        ProtoClient(publisher.url, origin=origin).close()
    ProtoClient(publisher.url).close()  # no Origin header: not a browser


def test_origin_and_host_rules() -> None:
    assert origin_allowed(None, ())
    assert origin_allowed("https://dash.example", ("https://dash.example",))
    assert not origin_allowed("null", ())
    assert not origin_allowed("http://localhost.evil.com", ())
    assert not origin_allowed("file://localhost", ())
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")


def test_stop_releases_the_port() -> None:
    pub, _ = make_publisher()
    c = ProtoClient(pub.url)
    pub.stop()
    with pytest.raises(ConnectionClosed):
        c.recv(timeout=10)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", pub.port))
    pub.publish([{"type": "step"}])  # after stop: ignored, never raises


def test_port_in_use_is_reported_by_start() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        pub = Publisher(PublisherConfig(port=s.getsockname()[1]), hello=dict)
        with pytest.raises(OSError):
            pub.start()
