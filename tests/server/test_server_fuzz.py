"""Hostile clients: hundreds of malformed frames, oversized frames, and a client that never reads.

None of them may stop the engine, close a well-behaved connection, or make the engine wait.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosedError

from tests.server.test_server_support import (
    Msg,
    ProtoClient,
    ServerProcess,
    is_reset,
    running_server,
    stuck_client,
)

# One xdist worker runs this module, so its module-scoped server is set up once (tests spread
# over both workers had each worker set up its own).
pytestmark = pytest.mark.xdist_group("test_server_fuzz")

VOCAB = 49152
CODES = {"invalid_json", "unknown_type", "invalid_request", "too_large", "not_found", "capacity"}
BAD_VALUES: list[Any] = [
    True, False, None, -1, 0, -(10**30), 10**400, 1.5, -0.0, "7", "", [], [1], {}, {"a": 1},
    1e308, -1e308, "NaN", 2**63, 2**64,
]  # fmt: skip


def hostile_frames(rng: random.Random, n: int) -> list[tuple[str | bytes, str | None, set[str]]]:
    """(frame, id the reply must echo, acceptable error codes), every one of them an error."""
    frames: list[tuple[str | bytes, str | None, set[str]]] = []

    def obj(cmd: dict[str, Any], codes: set[str]) -> None:
        cid = f"f{len(frames)}"
        frames.append((json.dumps({**cmd, "id": cid}), cid, codes))

    def raw(frame: str | bytes, codes: set[str]) -> None:
        frames.append((frame, None, codes))

    fields = {
        "submit": ["max_tokens", "temperature", "top_k", "top_p", "ignore_eos", "chat", "seed"],
        "set_config": ["max_extend_tokens", "policy"],
        "abort": ["uid"],
    }
    while len(frames) < n:
        pick = rng.randrange(14)
        if pick == 0:  # random printable garbage
            raw("".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(1, 200))),
                {"invalid_json"})  # fmt: skip
        elif pick == 1:  # random bytes, as a binary frame
            raw(rng.randbytes(rng.randrange(1, 300)), {"invalid_json"})
        elif pick == 2:  # JSON that is not an object
            raw(json.dumps(rng.choice([1, "submit", None, [1, 2], True, 2.5, [{"type": "stats"}]])),
                {"invalid_json"})  # fmt: skip
        elif pick == 3:  # deep nesting, NaN, truncated objects
            raw(rng.choice(["[" * 50_000, '{"a":' * 30_000, '{"type": "submit", "prompt": NaN}',
                            '{"type": "stats"', "{'type': 'stats'}", '{"type": Infinity}']),
                {"invalid_json"})  # fmt: skip
        elif pick == 4:  # missing, mistyped or unknown type
            kind = rng.choice([None, 1, "", "SUBMIT", "hello", "step", ["submit"], "config"])
            obj({"type": kind, "prompt": "x"} if kind is not None else {"prompt": "x"},
                {"unknown_type"})  # fmt: skip
        elif pick == 5:  # a submit field of the wrong type or out of range
            name = rng.choice(fields["submit"])
            value = rng.choice(BAD_VALUES)
            if name in ("ignore_eos", "chat") and isinstance(value, bool):
                value = "yes"
            if name == "temperature" and value in (1.5, 1e308, 0, -0.0, 2**63, 2**64):
                value = -1
            if name == "top_p" and value == 1.5 and rng.random() < 0.5:
                value = 0
            if name == "seed" and value in (0, None, 2**63 - 1):
                value = -5
            if name == "max_tokens" and type(value) is int and value >= 1:
                value = 0
            if name == "top_k" and value in (-1,):
                value = -7
            obj({"type": "submit", "prompt": "hello", name: value}, {"invalid_request"})
        elif pick == 6:  # bad prompts
            prompt = rng.choice([
                {"prompt": ""}, {"prompt": 12}, {"prompt": None}, {"input_ids": []},
                {"input_ids": [VOCAB]}, {"input_ids": [-1, 5]}, {"input_ids": [1, True]},
                {"input_ids": [1.0]}, {"input_ids": "1 2 3"}, {"prompt": "a", "input_ids": [1]},
                {}, {"input_ids": [5], "chat": True}, {"prompt": "\ud800 lone surrogate"},
            ])  # fmt: skip
            obj({"type": "submit", **prompt}, {"invalid_request"})
        elif pick == 7:  # prompts that can never fit
            obj({"type": "submit", "input_ids": [7] * rng.randrange(1100, 5000)}, {"too_large"})
        elif pick == 8:
            obj({"type": "submit", "prompt": "hi", "max_tokens": rng.choice([10**6, 10**40])},
                {"too_large"})  # fmt: skip
        elif pick == 9:  # bad set_config
            name = rng.choice(fields["set_config"])
            value = rng.choice([*BAD_VALUES, "fastest", "Mixed"])
            if name == "max_extend_tokens" and type(value) is int and 1 <= value < 2**31:
                value = 0
            obj({"type": "set_config", name: value}, {"invalid_request"})
        elif pick == 10:  # bad abort uids
            value = rng.choice([v for v in BAD_VALUES if type(v) is not int or v < 0 or v >= 2**63])
            obj({"type": "abort", "uid": value}, {"invalid_request"})
        elif pick == 11:  # aborts of uids that do not exist
            obj({"type": "abort", "uid": rng.randrange(10**6, 10**9)}, {"not_found"})
        elif pick == 12:  # an id that is not a string is not echoed
            raw(json.dumps({"type": "stats", "id": rng.choice([1, [], {"x": 1}, True])}),
                {"invalid_request"})  # fmt: skip
        else:  # top_k beyond the vocabulary, top_p of zero
            obj({"type": "submit", "prompt": "x", **rng.choice([{"top_k": VOCAB + 1},
                                                               {"top_p": 0.0}, {"top_k": 0}])},
                {"invalid_request"})  # fmt: skip
    return frames


# What a client that never reads may cost: the server keeps at most QUEUE messages for it and
# disconnects it once it has lost DROP_LIMIT. Small, so the stuck-client test pumps few messages;
# a reading client never comes near them (its kernel buffers alone hold far more), nor do the
# replies to the hostile frames, which a reading client drains as they come.
QUEUE = 512
DROP_LIMIT = 5 * QUEUE  # past what the stuck client loses while its bound is checked


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    # One server for every hostile client: the stuck-client test's settings (a naive cache keeps
    # its traffic steady; a small kernel buffer per client fills within a few dozen steps) change
    # nothing the other tests check.
    with running_server(tiny_llama_dir, "--max-running-req", "16", "--cache-type", "naive",
                        "--client-queue", str(QUEUE), "--client-drop-limit", str(DROP_LIMIT),
                        "--client-socket-buffer", "65536") as srv:  # fmt: skip
        yield srv


def test_hostile_frames_get_errors_and_the_engine_carries_on(server: ServerProcess) -> None:
    frames = hostile_frames(random.Random(1234), 600)
    c = server.client()
    for frame, _, _ in frames:  # pipelined: no waiting for replies
        c.send(frame)
    replies = [c.until(lambda m: m["type"] in ("error", "accepted")) for _ in frames]
    for (frame, cid, codes), reply in zip(frames, replies, strict=True):
        assert reply["type"] == "error", (frame[:200], reply)
        assert reply["code"] in codes and reply["code"] in CODES, (frame[:200], reply)
        assert reply["id"] == cid and isinstance(reply["message"], str)
    assert len({r["code"] for r in replies}) == 5  # all but capacity were exercised
    reply = c.reply({"type": "submit", "id": "ok", "prompt": "Still there?", "max_tokens": 4})
    assert reply["type"] == "accepted"
    done = c.until(lambda m: m.get("event") == "finished" and m["uid"] == reply["uid"])
    assert done["output_len"] >= 1
    stats = c.stats()
    assert stats["engine_errors"] == 0 and stats["integrity"] == "ok"
    c.close()


def test_an_oversized_frame_closes_only_that_connection(server: ServerProcess) -> None:
    bystander = server.client()
    c = server.client()
    c.send(json.dumps({"type": "submit", "prompt": "x" * (2**20)}))
    with pytest.raises(ConnectionClosedError) as info:
        c.until(lambda m: False, timeout=60)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    assert bystander.stats()["integrity"] == "ok"
    bystander.close()


def test_extreme_but_valid_sampling_values_leave_the_engine_running(server: ServerProcess) -> None:
    c = server.client()  # the module's server: one start fewer
    extremes: list[dict[str, Any]] = [
        {"temperature": 1e308}, {"temperature": 1e-300}, {"temperature": 5e-324},
        {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 1.0, "top_k": VOCAB},
        {"temperature": 1.0, "top_k": 1}, {"temperature": 0.7, "seed": 2**63 - 1},
    ]  # fmt: skip
    for k, fields in enumerate(extremes):
        uid = submit_ok(c, f"x{k}", prompt="Hello", max_tokens=3, **fields)
        c.until(lambda m, u=uid: m.get("event") == "finished" and m["uid"] == u, timeout=60)
    stats = c.stats()
    assert stats["engine_errors"] == 0 and stats["integrity"] == "ok"
    c.close()


class Feeder:
    """Keeps `width` requests in flight and records every step message it receives. On a busy
    machine it may lag past its queue and lose the `finished` events it refills on: when the
    socket falls silent, it asks the server how many requests are in flight and tops up."""

    def __init__(self, c: ProtoClient, width: int) -> None:
        self.c = c
        self.width = width
        self.rng = random.Random(99)
        self.steps: list[Msg] = []
        for _ in range(width):
            self.submit()

    def submit(self) -> None:
        prompt = [self.rng.randrange(3, VOCAB) for _ in range(8)]
        self.c.send({"type": "submit", "input_ids": prompt, "max_tokens": 64, "ignore_eos": True})

    def pump(self) -> Msg:
        try:
            m = self.c.recv(timeout=2.0)
        except TimeoutError:
            self.c.send({"type": "stats", "id": "feeder-top-up"})
            return {"type": "silence"}
        if m["type"] == "step":
            self.steps.append(m)
        elif m["type"] == "request" and m["event"] == "finished":
            self.submit()
        elif m["type"] == "stats" and m["id"] == "feeder-top-up":
            for _ in range(self.width - m["queue"]["waiting"] - m["queue"]["running"]):
                self.submit()
        elif m["type"] == "error":
            raise AssertionError(m)
        return m

    def steps_ahead(self, n: int) -> None:
        """Read on until `n` more step messages have arrived."""
        want = len(self.steps) + n
        while len(self.steps) < want:
            self.pump()

    def stats(self) -> Msg:
        self.c.send({"type": "stats", "id": "feeder-stats"})
        while True:
            m = self.pump()
            if m["type"] == "stats" and m["id"] == "feeder-stats":
                return m


def test_a_client_that_never_reads_costs_the_engine_nothing_until_it_is_dropped(
    server: ServerProcess,
) -> None:
    # Not a comparison of step rates, which a busy 2-core machine can miss by any margin, but
    # the mechanism that makes a stuck client harmless: the engine hands messages over without
    # waiting (`publish()`), and the server keeps at most --client-queue of them for a client
    # that does not read; every later one for it is dropped. So the engine never waits for it,
    # and what it costs the server is bounded; once it has lost --client-drop-limit messages it
    # is disconnected. Last in this module: it leaves requests running.
    feeder = Feeder(server.client(), width=16)
    feeder.steps_ahead(20)  # warm up
    deadline = time.monotonic() + 60  # generous: never a speed assertion
    while (before := feeder.stats())["clients"] != 1:  # the earlier tests' clients are gone
        assert time.monotonic() < deadline, before["clients"]
        feeder.steps_ahead(5)
    stuck = stuck_client(server.port)
    while (full := feeder.stats())["dropped"] == before["dropped"]:  # its buffers filled
        # the server's keepalive closes a peer that never answers pings (about 40 s)
        assert full["clients"] == 2, "the stuck client was closed before its buffers filled"
        feeder.steps_ahead(10)
    first = len(feeder.steps)
    while (s := feeder.stats())["messages_published"] < full["messages_published"] + 3 * QUEUE:
        feeder.steps_ahead(10)
    assert s["clients"] == 2 and s["engine_errors"] == 0 and s["slow_disconnects"] == 0
    published = s["messages_published"] - full["messages_published"]
    dropped = s["dropped"] - full["dropped"]
    # the stuck client was sent nothing more: at most its queue's worth was still kept while
    # `published` (over 3 queues' worth) went by, the rest dropped
    assert published - QUEUE <= dropped <= published, (published, dropped)
    assert len(feeder.steps) - first >= 50  # and the engine kept stepping meanwhile
    # past the drop limit the server disconnects it
    while (s := feeder.stats())["slow_disconnects"] == 0:
        assert s["clients"] == 2, "the stuck client was closed before it was dropped"
        feeder.steps_ahead(10)
    assert s["dropped"] - before["dropped"] > DROP_LIMIT  # it was the limit that was hit
    assert is_reset(stuck, timeout=30)
    stuck.close()
    while (s := feeder.stats())["clients"] != 1:
        feeder.steps_ahead(5)
    assert s["slow_disconnects"] == 1  # the stuck client, never the reader
    numbers = [m["step"] for m in feeder.steps]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # reader lost none
    assert s["integrity"] == "ok" and s["engine_errors"] == 0
    feeder.c.close()


def submit_ok(c: ProtoClient, cid: str, **fields: Any) -> int:
    reply = c.reply({"type": "submit", "id": cid, **fields})
    assert reply["type"] == "accepted", reply
    return reply["uid"]
