"""KV events that survive gaps: unknown event types skipped one by one, missed
batches recovered from vLLM's replay socket (played here by a ROUTER that answers as vLLM 0.32's
`ZmqEventPublisher._service_replay` does), what could not be recovered said, prefix-cache reuse
counted, and raw frames kept on disk and read back."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")

from instrumentation.watch.frames import FrameRecorder, read_frames  # noqa: E402
from instrumentation.watch.kv_events import KvEventsReader, hit_rate  # noqa: E402
from instrumentation.watch.zmq_sub import replay  # noqa: E402

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes: list[int], parent: int | None = None) -> dict[str, Any]:
    # vLLM 0.32's BlockStored as msgspec writes a tagged struct: a map with its `type`
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(range(16 * len(hashes))), "block_size": 16, "lora_id": None,
            "medium": "CPU", "lora_name": None, "group_idx": 0}  # fmt: skip


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "CPU", "group_idx": 0}


def frames(seq: int, *events: dict[str, Any], ts: float = 1.0e9) -> list[bytes]:
    # vLLM 0.32's KVEventBatch is array_like: [ts, events, data_parallel_rank]
    payload = msgpack.packb([ts + seq, list(events), 0])
    return [b"", seq.to_bytes(8, "big"), payload]


def reader(**kw: Any) -> tuple[KvEventsReader, Counter[str]]:
    status: Counter[str] = Counter()
    return KvEventsReader(status, lambda: 0.0, **kw), status


def test_an_unknown_event_type_costs_only_itself() -> None:
    kv, status = reader()
    pinned = {"type": "BlockPinned", "block_hashes": [2]}  # a type this reader does not know
    (msg,) = kv.feed(frames(0, stored([1, 2, 3]), pinned, removed([3]), ["BlockMoved", [4]]))
    assert msg["stored_blocks"] == 3 and msg["removed_blocks"] == 1 and msg["blocks"] == 2
    assert msg["unknown_events"] == 2
    assert status["kv_unknown_events"] == 2 and status["kv_unknown:BlockPinned"] == 1
    assert status["kv_unknown:BlockMoved"] == 1 and status["unreadable"] == 0


def test_reuse_is_counted_as_hits_not_as_stored_blocks() -> None:
    kv, _ = reader()
    first = kv.feed(frames(0, stored([1, 2, 3])))
    again = kv.feed(frames(1, stored([1, 2]), stored([4], parent=2)))  # 2 hits, 1 new block
    assert (first[0]["stored_blocks"], first[0]["reused_blocks"]) == (3, 0)
    assert (again[0]["stored_blocks"], again[0]["reused_blocks"]) == (1, 2)
    assert again[0]["blocks"] == 4
    assert hit_rate(first + again) == pytest.approx(2 / 6)
    assert hit_rate(first) is None  # no reuse reported: not a measured 0 %


class ReplayingEngine:
    """vLLM's replay socket: a ROUTER that, sent a start sequence number, resends every buffered
    batch from it on as (topic, seq, payload) and ends with an empty message carrying seq −1."""

    def __init__(self, buffered: list[list[bytes]]) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffered = buffered
        self.requests: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            client, _, start = self.sock.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            for topic, seq, payload in self.buffered:
                if int.from_bytes(seq, "big") >= first:
                    self.sock.send_multipart((client, b"", topic, seq, payload))
            self.sock.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


def test_missed_batches_are_recovered_from_the_replay_socket_in_order() -> None:
    published = [
        frames(0, stored([1, 2])),
        frames(1, stored([3])),
        frames(2, removed([1])),
        frames(3, stored([4, 5])),
        frames(4, removed([2, 3])),
    ]
    # The engine's replay buffer no longer holds batch 1 (vLLM keeps the last buffer_steps).
    engine = ReplayingEngine([published[0], *published[2:]])
    try:
        kv, status = reader(replay=lambda start: replay(engine.endpoint, start))
        out = kv.feed(published[0])
        out += kv.feed(published[3])  # batches 1 and 2 were missed: asked for
        out += kv.feed(published[2])  # the live copy of a batch already replayed: a duplicate
        out += kv.feed(published[4])
    finally:
        engine.close()
    assert engine.requests == [1]
    assert [m["batch_seq"] for m in out] == [0, 2, 3, 4]  # in order, each once
    assert out[1]["gap"] == {"lost": 1, "recovered": 0}  # batch 1 is gone: the page says so
    assert "gap" not in out[2] and "gap" not in out[3]
    assert [m["blocks"] for m in out] == [2, 1, 3, 2]  # 4 and 5 are left (3 was never seen)
    assert status["kv_recovered"] == 1 and status["lost"] == 1 and status["kv_duplicates"] == 1
    assert status["removed_unknown_blocks"] == 1  # block 3, stored in the lost batch


def test_a_gap_without_replay_is_said_on_the_next_batch() -> None:
    kv, status = reader()
    (first,) = kv.feed(frames(5, stored([1])))  # the watch started after five batches
    (later,) = kv.feed(frames(9, stored([2])))
    assert first["gap"] == {"lost": 5, "recovered": 0} and later["gap"]["lost"] == 3
    assert status["lost"] == 8


def test_an_engine_that_does_not_answer_replay_is_not_waited_for_forever() -> None:
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        assert replay(f"tcp://127.0.0.1:{port}", 0, timeout_ms=200) is None
    finally:
        silent.close(linger=0)


def test_frames_round_trip_and_a_cut_file_reads_to_its_last_whole_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kv.frames"
    rec = FrameRecorder(path)
    sent = [frames(i, stored([i])) for i in range(3)]
    for i, f in enumerate(sent):
        rec.write(f, at=10.0 + i)
    rec.close()
    got = list(read_frames(path))
    assert [f for _, f in got] == sent and [t for t, _ in got] == [0.0, 1.0, 2.0]
    path.write_bytes(path.read_bytes()[:-5])  # a recorder killed mid-message
    assert [f for _, f in read_frames(path)] == sent[:2]
    (tmp_path / "not.frames").write_bytes(b"hello")
    with pytest.raises(ValueError, match="not a frames file"):
        list(read_frames(tmp_path / "not.frames"))
