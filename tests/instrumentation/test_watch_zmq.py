"""Forward-pass metrics and KV-cache events over a real ZMQ socket.

The test plays the engine: it binds a PUB socket on tcp://127.0.0.1:<random port>, as SGLang and
vLLM do, and publishes messages encoded with msgspec from structs that carry the upstream
definitions' names, options and field order (SGLang's and vLLM's `ForwardPassMetrics`, vLLM's
`KVEventBatch` in both its older array layout and its newer map layout), framed as upstream
frames them: (topic, sequence number as 8 bytes big-endian, payload). The watch serves the
protocol on a free port; a WebSocket client sees the steps and the KV view follow.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from websockets.sync.client import ClientConnection, connect  # noqa: E402

from app.aggregate import kv_events_figure  # noqa: E402
from app.state import EventStore  # noqa: E402
from instrumentation.watch.run import Watch, WatchConfig  # noqa: E402

# ---- the engines' wire types: upstream names and options (the test's own definitions) ----


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class VllmForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    """vLLM's native one (with timing_scope)."""

    version: int = 1
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    timing_scope: str = "execute_model_cuda"
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()


class SglangForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    """SGLang's first published layout (no version, no counter_id)."""

    worker_id: str = ""
    dp_rank: int = 0
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()


class SglangForwardPassMetricsArray(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """The versioned layout, encoded positionally (array_like) as some consumers declare it."""

    version: int = 1
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()


def kv_event_types(array_like: bool) -> dict[str, Any]:
    """vLLM's KV event structs: `array_like=True` in older releases, maps in newer ones."""

    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {
        "EventBatch": EventBatch,
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }


# ---- the engine side and the page side ----


class Engine:
    """A PUB socket bound on a random local port, publishing as the engines do."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()

    def publish(self, obj: Any) -> None:
        self.sock.send_multipart((b"", self.seq.to_bytes(8, "big"), self.encoder.encode(obj)))
        self.seq += 1

    def until_subscribed(self, watch: Watch, key: str, probe: Any) -> None:
        """ZMQ drops what is published before a subscriber has joined: publish a probe (a
        heartbeat, an empty batch) until the watch has counted one."""
        deadline = time.monotonic() + 20
        while watch.emitter.status[key] == 0:
            assert time.monotonic() < deadline, "the watch never received a probe"
            self.publish(probe)
            time.sleep(0.05)

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


def start_watch(config: WatchConfig) -> tuple[Watch, threading.Thread]:
    watch = Watch(config)
    runner = threading.Thread(target=watch.run, daemon=True)
    runner.start()
    assert watch.served.wait(10) and watch.url
    return watch, runner


def receive(ws: ClientConnection, kind: str, n: int, store: EventStore | None = None) -> list[dict]:
    """The next `n` messages of `kind`; every message received also goes to the page's
    `store`, when given, as the page's connection thread would apply it."""
    got: list[dict] = []
    while len(got) < n:
        msg = json.loads(ws.recv(timeout=10))
        if store is not None:
            store.apply(msg)
        if msg["type"] == kind:
            got.append(msg)
    return got


def scheduled(**kw: int) -> ScheduledRequestMetrics:
    return ScheduledRequestMetrics(**kw)


# ---- forward-pass metrics ----


@pytest.mark.parametrize("source", ["vllm-fpm", "sglang-fpm"])
def test_forward_pass_metrics_become_steps(engine: Engine, source: str) -> None:
    watch, runner = start_watch(WatchConfig(source=source, target=engine.endpoint, port=0))
    try:
        with connect(watch.url or "", open_timeout=10) as ws:
            hello = json.loads(ws.recv(timeout=10))
            assert hello["engine"]["source"] == source and hello["engine"]["external"] is True
            engine.until_subscribed(watch, "messages", VllmForwardPassMetrics(worker_id="w"))
            queued = QueuedRequestMetrics(
                num_prefill_requests=3, sum_prefill_tokens=900, num_decode_requests=1
            )
            passes = [
                VllmForwardPassMetrics(
                    worker_id="w", counter_id=1, wall_time=0.050, queued_requests=queued,
                    scheduled_requests=scheduled(num_prefill_requests=2, sum_prefill_tokens=1024, sum_prefill_kv_tokens=256),
                ),
                SglangForwardPassMetricsArray(
                    worker_id="w", counter_id=2, wall_time=0.020,
                    scheduled_requests=scheduled(num_prefill_requests=1, sum_prefill_tokens=100, num_decode_requests=2, sum_decode_kv_tokens=2048),
                ),
                SglangForwardPassMetrics(
                    worker_id="w", dp_rank=1, wall_time=0.010,
                    scheduled_requests=scheduled(num_decode_requests=3, sum_decode_kv_tokens=3000),
                ),
                VllmForwardPassMetrics(worker_id="w", counter_id=4),  # idle heartbeat: no step
            ]  # fmt: skip
            for p in passes:
                engine.publish(p)
            steps = receive(ws, "step", 3)
        assert [s["phase"] for s in steps] == ["prefill", "mixed", "decode"]
        assert [s.get("prompt_tokens") for s in steps] == [1024, 100, 0]
        assert [s["decode_requests"] for s in steps] == [0, 2, 3]
        assert [s["prefill_requests"] for s in steps] == [2, 1, 0]
        assert steps[0]["queue"] == {"waiting": 4} and steps[0]["t_source"] == "received"
        assert steps[0]["t1"] - steps[0]["t0"] == pytest.approx(0.050)
        assert (
            steps[0]["fpm"]["scheduled_requests"]["sum_prefill_kv_tokens"] == 256
        )  # upstream names
        assert steps[2]["dp_rank"] == 1 and steps[2]["items"] == []
        assert [s["seq"] for s in steps] == list(
            range(3)
        )  # probes and heartbeats are no broadcasts
        assert all(s["source"] == source for s in steps)
    finally:
        watch.stop.set()
        runner.join(10)
    assert watch.emitter.status["unreadable"] == 0 and watch.emitter.status["steps"] == 3


def test_malformed_payloads_are_counted(engine: Engine) -> None:
    watch, runner = start_watch(WatchConfig(source="vllm-fpm", target=engine.endpoint, port=0))
    try:
        engine.until_subscribed(watch, "messages", VllmForwardPassMetrics(worker_id="w"))
        before = watch.emitter.status["messages"]
        engine.sock.send_multipart((b"", (99).to_bytes(8, "big"), b"\xc1 not msgpack"))
        engine.publish(VllmForwardPassMetrics(version=2, wall_time=0.1))  # a future schema
        engine.publish([1, 2, 3])  # msgpack, but no ForwardPassMetrics
        deadline = time.monotonic() + 10
        while watch.emitter.status["messages"] < before + 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.stop.set()
        runner.join(10)
    assert (
        watch.emitter.status["unreadable"] == 2 and watch.emitter.status["unsupported_version"] == 1
    )
    assert watch.emitter.status["lost"] >= 1  # the sequence number jumped to 99 and back


# ---- KV events ----


@pytest.mark.parametrize("array_like", [True, False], ids=["array-layout", "map-layout"])
def test_kv_events_feed_the_kv_view(engine: Engine, array_like: bool) -> None:
    t = kv_event_types(array_like)
    batch, stored, removed = t["EventBatch"], t["BlockStored"], t["BlockRemoved"]
    watch, runner = start_watch(
        WatchConfig(source="vllm-kv-events", target=engine.endpoint, port=0, total_blocks=1000)
    )
    page = EventStore()  # the page's store, fed what the page would receive
    try:
        with connect(watch.url or "", open_timeout=10) as ws:
            page.apply(json.loads(ws.recv(timeout=10)))  # hello
            engine.until_subscribed(watch, "kv_batches", batch(ts=time.time(), events=[]))

            def store(hashes: list[Any], parent: Any) -> Any:
                return stored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(16 * len(hashes))),
                              block_size=16, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip

            engine.publish(
                batch(ts=time.time(), events=[store([1, 2, 3], None)], data_parallel_rank=0)
            )
            engine.publish(batch(ts=time.time(), events=[store([b"\x04" * 32, b"\x05" * 32], 3)]))
            engine.publish(
                batch(
                    ts=time.time(),
                    events=[
                        removed(block_hashes=[2], medium="GPU"),
                        removed(block_hashes=[77], medium="GPU"),
                    ],
                )
            )
            engine.publish(
                batch(ts=time.time(), events=[t["AllBlocksCleared"](), store([9], None)])
            )
            views: list[dict] = []
            while len(views) < 4:  # skip the probes: empty batches
                (v,) = receive(ws, "kv_events", 1, page)
                if v["stored_blocks"] or v["removed_blocks"] or v["cleared"]:
                    views.append(v)
        assert [v["blocks"] for v in views] == [3, 5, 4, 1]
        assert [v["tokens"] for v in views] == [48, 80, 64, 16]
        assert [v["stored_blocks"] for v in views] == [3, 2, 0, 1]
        assert [v["removed_blocks"] for v in views] == [0, 0, 1, 0]
        assert [v["cleared"] for v in views] == [False, False, False, True]
        assert (
            views[0]["dp_rank"] == 0
            and views[0]["block_size"] == 16
            and views[0]["total_blocks"] == 1000
        )
        assert views[-1]["by_medium"] == {"GPU": 1}
        kv_seqs = [v["kv_seq"] for v in views]
        assert kv_seqs == list(range(kv_seqs[0], kv_seqs[0] + 4)) and "seq" not in views[0]
    finally:
        watch.stop.set()
        runner.join(10)
    # the page's KV view follows: its store holds the batches, its figure draws what is held
    kept = page.snapshot().kv_events
    assert [m["kv_seq"] for m in kept if m in views] == kv_seqs
    fig = kv_events_figure(kept, x="time")
    held = next(t for t in fig.data if t.name == "blocks held")
    changed = [
        m["blocks"] for m in kept if m["stored_blocks"] or m["removed_blocks"] or m["cleared"]
    ]
    assert changed == [3, 5, 4, 1] and list(held.y)[-1] == 1
    assert list(held.y) == [m["blocks"] for m in kept]
    (clear,) = [t for t in fig.data if t.name == "cache cleared"]
    assert list(clear.y) == [1]
    assert any(t.name == "pool (1,000 blocks)" for t in fig.data)
    status = watch.emitter.status
    assert status["removed_unknown_blocks"] == 1  # hash 77 was stored before the watch started
    assert status["kv_BlockStored"] == 3 and status["kv_AllBlocksCleared"] == 1


def test_a_late_client_gets_the_kv_view_and_steps_in_hello(engine: Engine) -> None:
    """FPM steps and KV events in one watch: a page that connects later draws both from hello."""
    kv = Engine()
    t = kv_event_types(False)
    watch, runner = start_watch(
        WatchConfig(source="vllm-fpm", target=engine.endpoint, port=0, kv_events=kv.endpoint)
    )
    try:
        engine.until_subscribed(watch, "messages", VllmForwardPassMetrics(worker_id="w"))
        kv.until_subscribed(watch, "kv_batches", t["EventBatch"](ts=time.time(), events=[]))
        engine.publish(
            VllmForwardPassMetrics(
                wall_time=0.01, scheduled_requests=scheduled(num_decode_requests=4)
            )
        )
        kv.publish(t["EventBatch"](ts=time.time(), events=[t["BlockStored"](
            block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
            lora_id=None, medium=None, lora_name=None)]))  # fmt: skip
        deadline = time.monotonic() + 10
        status = watch.emitter.status
        while (status["steps"] < 1 or status["kv_BlockStored"] < 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        # until the server thread has put them into the history
        while watch.emitter.delivered < status["kv_batches"] + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with connect(watch.url or "", open_timeout=10) as ws:
            hello = json.loads(ws.recv(timeout=10))
    finally:
        watch.stop.set()
        runner.join(10)
        kv.close()
    assert [s["decode_requests"] for s in hello["history"]["steps"]] == [4]
    assert hello["history"]["kv_events"][-1]["blocks"] == 1
    # a page connecting now draws both from hello: the KV batch at the step it followed
    store = EventStore()
    store.apply(hello)
    snap = store.snapshot()
    assert snap.kv_events[-1]["blocks"] == 1
    fig = kv_events_figure(snap.kv_events, snap.steps)
    held = next(t for t in fig.data if t.name == "blocks held")
    assert list(held.x)[-1] == snap.steps[-1]["step"] and list(held.y)[-1] == 1
    assert fig.layout.xaxis.title.text == "engine step"
    assert hello["seq"] == 0 and hello["engine"]["watch"]["steps"] == 1


def test_the_watch_can_bind_for_an_engine_that_connects() -> None:
    """vLLM connects its PUB socket when the endpoint names a host (no `*`): the watch binds."""
    import socket

    with socket.socket() as s:  # a free port for the watch to bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    watch, runner = start_watch(
        WatchConfig(source="vllm-fpm", target=endpoint, port=0, zmq_bind=True)
    )
    pub = zmq.Context.instance().socket(zmq.PUB)
    try:
        pub.connect(endpoint)
        probe = msgspec.msgpack.encode(VllmForwardPassMetrics(worker_id="w"))
        deadline = time.monotonic() + 20
        while watch.emitter.status["messages"] == 0 and time.monotonic() < deadline:
            pub.send_multipart((b"", (0).to_bytes(8, "big"), probe))
            time.sleep(0.05)
        step = VllmForwardPassMetrics(
            wall_time=0.02, scheduled_requests=scheduled(num_decode_requests=1)
        )
        pub.send_multipart((b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode(step)))
        while watch.emitter.status["steps"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        pub.close(linger=0)
        watch.stop.set()
        runner.join(10)
    assert watch.emitter.status["steps"] == 1
