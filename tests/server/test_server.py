"""`python -m engine.server` end to end: a real server subprocess, real WebSocket clients.

Each test runs against the synchronous engine (the server test_openai_api shares, see
tests/server/conftest.py) and against an overlapped one of this module's own; each test uses
fresh random token ids so the prefix cache of an earlier test never changes what a later one sees
(unless it means to).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from instrumentation import PROTOCOL_MINOR
from tests.server.test_server_support import (
    MAX_RUNNING,
    MAX_WAITING,
    SHARED_FLAGS,
    Msg,
    ProtoClient,
    ServerProcess,
    running_server,
)

# One xdist worker runs this module and test_openai_api, so the server they share is set up once
# (tests spread over both workers had each worker set up its own).
pytestmark = pytest.mark.xdist_group("shared_server")


@pytest.fixture(scope="module", params=["--no-overlap", "--overlap"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Each test runs against the synchronous engine and the overlapped one (step N+1 launched
    before step N's tokens are read), which CUDA uses by default; both with the same limits."""
    if request.param == "--no-overlap":
        yield request.getfixturevalue("shared_server")
        return
    tiny_llama_dir = request.getfixturevalue("tiny_llama_dir")
    with running_server(tiny_llama_dir, *SHARED_FLAGS, request.param) as srv:
        srv.overlap = True  # type: ignore[attr-defined]
        yield srv


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def submit(c: ProtoClient, cid: str, **fields: Any) -> int:
    reply = c.reply({"type": "submit", "id": cid, **fields})
    assert reply["type"] == "accepted", reply
    return reply["uid"]


def set_config(c: ProtoClient, cid: str, **fields: Any) -> Msg:
    reply = c.reply({"type": "set_config", "id": cid, **fields})
    assert reply["type"] == "config", reply
    return reply


def until_ended(c: ProtoClient, uid: int) -> Msg:
    return c.until(
        lambda m: m["type"] == "request" and m["uid"] == uid
        and m["event"] in ("finished", "aborted", "rejected")
    )  # fmt: skip


def story(c: ProtoClient, uid: int) -> list[Msg]:
    """What `c` saw of one request: its request and token events, and steps that list it."""
    out = []
    for m in c.seen:
        if m["type"] in ("request", "token") and m["uid"] == uid:
            out.append(m)
        elif m["type"] == "step" and any(i["uid"] == uid for i in m["items"]):
            out.append(m)
    return out


def check_chapter_rules(steps: list[Msg], uid: int, prompt_len: int, cached_len: int) -> None:
    """Chunks then one prefill cover [cached_len, prompt_len); no step exceeds its budget."""
    pieces = [i for s in steps for i in s["items"] if i["uid"] == uid and i["kind"] != "decode"]
    assert [p["kind"] for p in pieces] == ["chunk"] * (len(pieces) - 1) + ["prefill"]
    assert sum(p["end"] - p["start"] for p in pieces) == prompt_len - cached_len
    assert pieces[0]["start"] == cached_len and pieces[-1]["end"] == prompt_len
    assert all(a["end"] == b["start"] for a, b in zip(pieces, pieces[1:], strict=False))
    for s in steps:
        prompt = sum(i["end"] - i["start"] for i in s["items"] if i["kind"] != "decode")
        decodes = sum(i["kind"] == "decode" for i in s["items"])
        assert prompt <= s["budget"] - (decodes if s["policy"] == "mixed" else 0)
        kv = s["kv"]
        assert kv["used"] + kv["cached"] + kv["free"] == kv["total"]


def test_submit_yields_the_whole_lifecycle_in_protocol_order(server: ServerProcess) -> None:
    c = server.client()
    set_config(c, "c0", max_extend_tokens=16, policy="prefill_first")
    prompt = ids(50, seed=1)
    uid = submit(c, "a1", input_ids=prompt, max_tokens=5, ignore_eos=True)
    done = until_ended(c, uid)
    seen = story(c, uid)
    events = [m["event"] for m in seen if m["type"] == "request"]
    assert events == ["queued", "admitted", "first_token", "finished"]
    queued, admitted = (
        m for m in seen if m["type"] == "request" and m["event"] in ("queued", "admitted")
    )
    assert queued["prompt_len"] == 50 and queued["max_tokens"] == 5
    steps = [m for m in seen if m["type"] == "step"]
    assert [s["budget"] for s in steps] == [16] * len(steps)
    check_chapter_rules(steps, uid, 50, admitted["cached_len"])
    assert len(steps) == 4 + 4  # ceil(50 / 16) prompt steps, then 4 decodes
    # Each step's message comes first, then its tokens, then its request events.
    kinds = [m["type"] if m["type"] != "request" else m["event"] for m in seen]
    assert kinds == [
        "queued", "step", "admitted", "step", "step", "step", "token", "first_token",
        *["step", "token"] * 4, "finished",
    ]  # fmt: skip
    tokens = [m for m in seen if m["type"] == "token"]
    assert len(tokens) == done["output_len"] == 5
    assert done["finish_reason"] == "length"
    assert done["text"] == "".join(t["text"] for t in tokens)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server: ServerProcess) -> None:
    c = server.client()
    prompt = ids(40, seed=2)
    for cid in ("first", "again"):
        uid = submit(c, cid, input_ids=prompt, max_tokens=2)
        until_ended(c, uid)
    admitted = [m for m in story(c, uid) if m.get("event") == "admitted"][0]
    assert admitted["cached_len"] == 39  # all but the last token, which is always computed
    check_chapter_rules([m for m in story(c, uid) if m["type"] == "step"], uid, 40, 39)


def test_hello_lets_a_late_client_redraw_the_past(server: ServerProcess) -> None:
    early = server.client()
    uids = [submit(early, f"h{k}", input_ids=ids(20, seed=10 + k), max_tokens=3) for k in range(3)]
    ended = {uid: until_ended(early, uid) for uid in uids}
    late = server.client()
    hello = late.hello
    engine = hello["engine"]
    facts = ("model", "device", "dtype", "vocab_size", "page_size", "num_pages", "max_seq_len")
    assert all(key in engine for key in facts)
    assert engine["vocab_size"] == 49152 and engine["max_frame_bytes"] == 2**20
    assert engine["max_running_req"] == MAX_RUNNING and hello["protocol"] == 1
    assert engine["overlap"] is server.overlap  # type: ignore[attr-defined]
    assert set(hello["config"]) == {"max_extend_tokens", "policy", "admission"}
    assert hello["now"] >= max(m["t"] for m in ended.values())
    steps_seen = [m for m in early.seen if m["type"] == "step"]
    history = hello["history"]["steps"]
    assert history[-len(steps_seen) :] == steps_seen  # the same messages, oldest first
    records = {r["uid"]: r for r in hello["history"]["requests"]}
    for uid, fin in ended.items():
        rec = records[uid]
        assert rec["state"] == "finished" and rec["text"] == fin["text"]
        assert rec["prompt_len"] == 20 and rec["output_len"] == 3 and rec["max_tokens"] == 3
        assert rec["t_finished"] == fin["t"] and rec["t_first_token"] is not None
        assert rec["metrics"]["time_to_first_token_seconds"] > 0


def test_set_config_mid_chunk_reaches_every_client(server: ServerProcess) -> None:
    a, b = server.client(), server.client()
    set_config(a, "slow", max_extend_tokens=1, policy="prefill_first")
    b.until(lambda m: m["type"] == "config" and m["id"] == "slow")
    uid = submit(a, "long", input_ids=ids(700, seed=3), max_tokens=2)
    a.until(lambda m: m["type"] == "step" and any(i["uid"] == uid for i in m["items"]))
    cfg = set_config(a, "c1", max_extend_tokens=24, policy="mixed")
    assert (cfg["max_extend_tokens"], cfg["policy"]) == (24, "mixed")
    assert b.until(lambda m: m["type"] == "config" and m["id"] == "c1") == cfg
    for c in (a, b):
        until_ended(c, uid)
    steps = [m for m in story(a, uid) if m["type"] == "step"]
    before = [s for s in steps if s["t0"] < cfg["t"]]
    after = [s for s in steps if s["t0"] > cfg["t"]]
    assert before and after, "the change did not land mid-chunk"
    assert all(s["budget"] == 1 for s in before[:-1])
    assert all(s["budget"] == 24 and s["policy"] == "mixed" for s in after)
    assert max(i["end"] - i["start"] for s in after for i in s["items"] if i["uid"] == uid) > 1
    check_chapter_rules(steps, uid, 700, 0)
    # Both clients received the same step messages from the first one both saw.
    steps_a = [m for m in a.seen if m["type"] == "step"]
    steps_b = [m for m in b.seen if m["type"] == "step"]
    first = max(steps_a[0]["step"], steps_b[0]["step"])
    assert [s for s in steps_a if s["step"] >= first] == [s for s in steps_b if s["step"] >= first]
    set_config(a, "restore", max_extend_tokens=256, policy="prefill_first")


def test_abort_mid_chunk_returns_kv_to_idle(server: ServerProcess) -> None:
    c = server.client()
    idle = c.stats()
    assert idle["kv"]["used"] == 0 and idle["kv"]["reserved"] == 0 and idle["integrity"] == "ok"
    set_config(c, "slow", max_extend_tokens=1)
    uid = submit(c, "victim", input_ids=ids(700, seed=4), max_tokens=8)
    c.until(lambda m: m["type"] == "step" and any(i["uid"] == uid and i["kind"] == "chunk"
                                                  for i in m["items"]))  # fmt: skip
    c.send({"type": "abort", "id": "x", "uid": uid})
    aborted = until_ended(c, uid)
    assert aborted["event"] == "aborted"
    after = c.stats()
    later = [m for m in c.seen if m["type"] == "step" and m["t0"] > aborted["t"]]
    assert not any(i["uid"] == uid for s in later for i in s["items"])
    kv = after["kv"]
    assert (kv["used"], kv["reserved"]) == (0, 0)
    assert kv["total"] == idle["kv"]["total"] and kv["cached"] >= idle["kv"]["cached"]
    assert kv["used"] + kv["cached"] + kv["free"] == kv["total"]
    assert after["queue"] == {"waiting": 0, "running": 0, "waiting_reason": None}
    assert after["integrity"] == "ok"
    for cid in ("again", None):  # already ended, and never existed
        c.send({"type": "abort", "id": cid, "uid": uid if cid else 10**9})
        err = c.until(lambda m: m["type"] == "error")
        assert err["code"] == "not_found" and err["id"] == cid
    set_config(c, "restore", max_extend_tokens=256)


def test_abort_is_acknowledged_and_its_event_follows(server: ServerProcess) -> None:
    """Protocol v1.1: an abort is acknowledged with `accepted`, its `aborted` event follows;
    every broadcast carries the next `seq`, and replies carry none."""
    c = server.client()
    assert c.hello["engine"]["instance"] and c.hello["protocol_minor"] == PROTOCOL_MINOR
    set_config(c, "slow", max_extend_tokens=8)
    ok = c.reply({"type": "submit", "id": "s", "input_ids": [5] * 40, "max_tokens": 200,
                  "ignore_eos": True})  # fmt: skip
    uid = ok["uid"]
    c.until(lambda m: m.get("type") == "step")
    ack = c.reply({"type": "abort", "id": "x", "uid": uid})
    assert ack == {"type": "accepted", "id": "x", "uid": uid}
    c.until(lambda m: m.get("event") == "aborted" and m["uid"] == uid)
    again = c.reply({"type": "abort", "id": "y", "uid": uid})
    assert again["type"] == "error" and again["code"] == "not_found"
    broadcasts = [m for m in c.seen if m["type"] in ("step", "token", "request", "config")]
    seqs = [m["seq"] for m in broadcasts]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all("seq" not in m for m in c.seen if m["type"] in ("accepted", "error"))
    set_config(c, "restore", max_extend_tokens=256)
    c.close()


def test_too_large_and_capacity(server: ServerProcess) -> None:
    c = server.client()
    max_seq = c.hello["engine"]["max_seq_len"]
    for cid, fields in [
        ("big", {"input_ids": ids(max_seq, seed=5), "max_tokens": 1}),
        ("long-out", {"prompt": "hi", "max_tokens": max_seq}),
        ("absurd", {"prompt": "hi", "max_tokens": 10**30}),
    ]:
        reply = c.reply({"type": "submit", "id": cid, **fields})
        assert reply["type"] == "error" and reply["code"] == "too_large", reply
    # Fill the running slots and the waiting room, then one more is turned away.
    long = {"max_tokens": max_seq - 20, "ignore_eos": True}
    uids = [submit(c, f"fill{k}", input_ids=ids(8, seed=100 + k), **long)
            for k in range(MAX_RUNNING)]  # fmt: skip
    c.until(lambda m: m["type"] == "step" and len(m["items"]) == MAX_RUNNING)
    uids += [submit(c, f"wait{k}", input_ids=ids(8, seed=200 + k), **long)
             for k in range(MAX_WAITING)]  # fmt: skip
    reply = c.reply({"type": "submit", "id": "one-more", "prompt": "hello"})
    assert reply["type"] == "error" and reply["code"] == "capacity"
    for uid in uids:
        c.send({"type": "abort", "uid": uid})
    for uid in uids:
        assert until_ended(c, uid)["event"] == "aborted"
    stats = c.stats()
    assert stats["kv"]["used"] == 0 and stats["integrity"] == "ok" and stats["engine_errors"] == 0
