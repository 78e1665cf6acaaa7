"""The live charts' Python half, without a browser: the encoder (a view model of new steps only)
and the per-tab feed that answers the browser's pulls from the store's deltas."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.live.encode import KINDS, PHASES, StepEncoder, ended_times, expand_columns, unpack
from app.live.feed import LiveFeed, ViewOptions
from app.state import EventStore
from instrumentation.fold import stalls
from tests.app.app_peer import synthetic_trace


def _step(n: int, items: list[dict], phase: str = "mixed", t0: float | None = None) -> dict:
    t0 = float(n) if t0 is None else t0
    return {
        "type": "step",
        "step": n,
        "t0": t0,
        "t1": t0 + 0.5,
        "phase": phase,
        "budget": 16,
        "items": items,
        "kv": {"total": 100, "used": 10, "cached": 5, "free": 85, "reserved": 30},
        "queue": {"waiting": 1, "running": 2},
    }


def _item(uid: int, kind: str, start: int, end: int, **extra: Any) -> dict:
    return {"uid": uid, "kind": kind, "start": start, "end": end, **extra}


def test_items_stack_decodes_first_then_prompt_then_wasted_work() -> None:
    step = _step(
        3,
        [
            _item(1, "chunk", 0, 10),
            _item(2, "decode", 40, 41),
            _item(4, "decode", 7, 8, wasted=True),
            _item(3, "decode", 20, 21),
        ],
    )
    out = StepEncoder().encode([step], {})
    it = out["items"]
    assert it["uid"] == [2, 3, 1, 4]
    assert it["base"] == [0, 1, 2, 12]
    assert [KINDS[k] for k in it["kind"]] == ["decode", "decode", "chunk", "decode"]
    assert it["w"] == [0, 0, 0, 1]
    s = out["steps"]
    assert (s["prompt"], s["decode"], s["wasted"], s["sampled"]) == ([10], [2], [1], [2])
    assert PHASES[s["phase"][0]] == "mixed" and s["step"] == [3] and s["budget"] == [16]
    assert (s["used"], s["cached"], s["free"], s["reserved"]) == ([10], [5], [85], [30])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_items_unpack_to_the_same_columns_batch_by_batch(seed: int) -> None:
    messages = synthetic_trace(400, seed_every=50)
    steps = [m for m in messages if m["type"] == "step"]
    rng = random.Random(seed)
    for s in rng.sample(steps, 20):  # wasted work and odd items, as the engine can send them
        for it in s["items"]:
            if rng.random() < 0.3:
                it["wasted"] = True
    encoder = StepEncoder()
    for batch in _split(steps, rng):
        ref = dict(encoder.ref)
        out = encoder.encode(batch, {})
        assert unpack(out["packed"], ref) == out["items"]


DATA_JS = Path(__file__).resolve().parents[2] / "app" / "live" / "static" / "data.js"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_the_browser_unpacks_batches_as_the_format_defines() -> None:
    """data.js's unpackItems (run in Node) against encode.unpack, batch by batch, with the
    decode stack carried from one batch to the next as the browser carries it."""
    messages = synthetic_trace(300, seed_every=40)
    steps = [m for m in messages if m["type"] == "step"]
    rng = random.Random(3)
    for s in rng.sample(steps, 15):
        s["items"][0]["wasted"] = True
    encoder, batches = StepEncoder(), []
    for batch in _split(steps, rng):
        batches.append((dict(encoder.ref), encoder.encode(batch, {})))
    script = (
        "globalThis.window = globalThis; require(process.argv[1]);"
        "const batches = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "let ref = new Map();"
        "const out = batches.map((pk) => { const u = window.stepscope.unpackItems(pk, ref);"
        " ref = u.ref; return u.cols; });"
        "console.log(JSON.stringify(out));"
    )
    done = subprocess.run(
        ["node", "-e", script, str(DATA_JS)],
        input=json.dumps([b["packed"] for _, b in batches]),
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(done.stdout)
    assert got == [unpack(b["packed"], ref) for ref, b in batches]
    assert got == [b["items"] for _, b in batches]


def test_constant_columns_travel_as_one_value() -> None:
    from app.live.encode import compact_columns

    cols = {"step": [4, 5, 6], "total": [100, 100, 100], "used": [1, 2, 2], "one": [7], "no": []}
    small = compact_columns(cols)
    assert small == {"step": [4, 5, 6], "total": 100, "used": [1, 2, 2], "one": [7], "no": []}
    assert expand_columns(small) == cols
    script = (
        "globalThis.window = globalThis; require(process.argv[1]);"
        "const c = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "console.log(JSON.stringify(window.stepscope.expandColumns(c)));"
    )
    if shutil.which("node"):
        done = subprocess.run(
            ["node", "-e", script, str(DATA_JS)],
            input=json.dumps({k: v for k, v in small.items() if k != "no"}),
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(done.stdout) == {k: v for k, v in cols.items() if k != "no"}


def test_steady_decoding_packs_to_almost_nothing_and_keeps_each_request_in_place() -> None:
    steps = [
        _step(0, [_item(u, "decode", 10, 11) for u in (5, 6, 7)]),
        _step(1, [_item(u, "decode", 11, 12) for u in (7, 6, 5)]),  # record order differs
        _step(2, [_item(u, "decode", 12, 13) for u in (5, 7)] + [_item(9, "chunk", 0, 8)]),
        _step(3, [_item(9, "chunk", 8, 16)]),  # prefill-first: no decode this step
        _step(4, [_item(u, "decode", 13, 14) for u in (5, 7)] + [_item(8, "decode", 3, 4)]),
    ]
    out = StepEncoder().encode(steps, {})
    pk = out["packed"]
    assert pk[0] == {"da": [5, 10, 6, 10, 7, 10]} and pk[1] == {}
    assert pk[2] == {"dd": [6], "p": [9, 0, 0, 8, 0]} and pk[3] == {"n": 1, "p": [9, 0, 8, 16, 0]}
    assert pk[4] == {"da": [8, 3]}
    it = out["items"]
    by_step = [[u for u, i in zip(it["uid"], it["i"], strict=True) if i == k] for k in range(5)]
    assert by_step == [[5, 6, 7], [5, 6, 7], [5, 7, 9], [9], [5, 7, 8]]  # the stack is kept
    assert unpack(pk, {}) == it


def test_request_rows_are_sent_when_what_the_charts_read_changed() -> None:
    enc = StepEncoder()
    queued = {"uid": 1, "state": "waiting", "t_queued": 0.5, "output_len": 0}
    assert enc.request_rows([queued], 10) == [[1, "waiting", 0.5, None, None]]
    assert enc.request_rows([{**queued, "output_len": 3}], 10) == []  # a new token: no row
    running = {**queued, "state": "running", "t_first_token": 0.75}
    assert enc.request_rows([running], 10) == [[1, "running", 0.5, 0.75, None]]
    done = {**running, "state": "finished", "t_finished": 2.0}
    assert enc.request_rows([done], 10) == [[1, "finished", 0.5, 0.75, 2.0]]
    assert 1 not in enc.rows  # ended: sent once, then forgotten


def _split(seq: list, rng: random.Random) -> list[list]:
    out, i = [], 0
    while i < len(seq):
        n = rng.randint(1, 40)
        out.append(seq[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_stalls_found_batch_by_batch_are_the_ones_found_over_the_whole_record(seed: int) -> None:
    messages = synthetic_trace(600, seed_every=60)
    steps = [m for m in messages if m["type"] == "step"]
    requests: dict[int, dict] = {}
    for m in messages:  # the request records the store would hold at the end
        if m["type"] == "request":
            rec = requests.setdefault(m["uid"], {"uid": m["uid"], "state": "waiting"})
            if m["event"] in ("finished", "aborted"):
                rec.update(state=m["event"], t_finished=m["t"])
            elif m["event"] == "admitted":
                rec["state"] = "running"
    ended = ended_times(requests.values())
    encoder = StepEncoder()
    closed, stalled, ongoing = [], [], []
    for batch in _split(steps, random.Random(seed)):
        out = encoder.encode(batch, ended)
        closed += out["stalls"]
        stalled += out["steps"]["stalled"]
        ongoing = out["ongoing"]
    # the shared fold's stalls (instrumentation.fold), over the whole record at once
    running = [u for u, r in requests.items() if r["state"] == "running"]
    expected = stalls(steps, running)
    numbers = [s["step"] for s in steps]
    done = sorted(
        (s.uid, numbers[s.first], numbers[s.last], round(s.seconds, 4))
        for s in expected
        if not s.ongoing
    )
    assert sorted((u, a, b, round(t, 4)) for u, a, b, t in closed) == done
    assert len(done) > 10  # the trace does stall (prefill-first phases)
    per_step = [0] * len(steps)
    for x in expected:
        for i in range(x.first, x.last + 1):
            per_step[i] += 1
    assert stalled == per_step
    still = sorted((s.uid, numbers[s.first]) for s in expected if s.ongoing)
    assert sorted((u, a) for u, a, *_ in ongoing) == still


def test_a_request_that_ended_is_not_stalled_after_its_end() -> None:
    steps = [
        _step(0, [_item(1, "prefill", 0, 5), _item(2, "prefill", 0, 5)]),
        _step(1, [_item(1, "decode", 5, 6), _item(2, "decode", 5, 6)]),
        _step(2, [_item(2, "decode", 6, 7)]),  # request 1 finished at step 1
        _step(3, [_item(2, "decode", 7, 8)]),
    ]
    enc = StepEncoder()
    first = enc.encode(steps[:2], {})
    rest = enc.encode(steps[2:], {1: steps[1]["t1"]})
    assert first["steps"]["stalled"] + rest["steps"]["stalled"] == [0, 0, 0, 0]
    assert rest["stalls"] == [] and rest["ongoing"] == []
    assert 1 not in enc.decoding


# ---- the feed ----------------------------------------------------------------------------------


class Engine:
    """Feeds an EventStore as a connection would: a hello, then steps and request events."""

    def __init__(self) -> None:
        self.store = EventStore()
        self.n = 0
        self.seq = 0
        self.store.apply(
            {
                "type": "hello",
                "protocol": 1,
                "now": 0.0,
                "seq": -1,
                "engine": {"model": "m", "page_size": 1, "num_pages": 100, "instance": "i1"},
                "config": {"max_extend_tokens": 16, "policy": "mixed"},
                "history": {"steps": [], "requests": []},
            }
        )

    def send(self, msg: dict) -> None:
        self.store.apply({**msg, "seq": self.seq})
        self.seq += 1

    def steps(self, k: int, uids: tuple[int, ...] = (0, 1)) -> None:
        for _ in range(k):
            items = [_item(u, "decode", 10 + self.n, 11 + self.n) for u in uids]
            self.send(_step(self.n, items))
            self.n += 1


OPTS = ViewOptions(window=50, xmode="step")


def _numbers(payload: dict) -> list[int]:
    return payload.get("steps", {}).get("step", [])


def test_the_feed_sends_each_step_once_and_nothing_when_nothing_is_new() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.send({"type": "request", "uid": 0, "event": "queued", "t": 0.0, "prompt_len": 5})
    eng.steps(80)
    first = feed.payload(eng.store, None, OPTS)
    assert first["reset"] and _numbers(first) == list(range(30, 80))  # the window's steps
    assert [r[0] for r in first["requests"]] == [0]
    eng.steps(3)
    second = feed.payload(eng.store, first["id"], OPTS)
    assert not second.get("reset") and second["base"] == first["id"]
    assert "engine" not in second and "requests" not in second  # nothing of them changed
    assert _numbers(second) == [80, 81, 82]
    assert len(second["packed"]) == 3  # only the new steps' items: work ∝ what is new
    assert unpack(second["packed"], {0: 90, 1: 90})["a"] == [90, 90, 91, 91, 92, 92]
    idle = feed.payload(eng.store, second["id"], OPTS)
    assert idle["id"] == second["id"] and "steps" not in idle
    eng.steps(2)
    third = feed.payload(eng.store, idle["id"], OPTS)
    assert _numbers(third) == [83, 84]


def test_a_browser_that_missed_a_batch_gets_it_again_from_where_it_is() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.steps(5)
    a = feed.payload(eng.store, None, OPTS)
    eng.steps(2)
    b = feed.payload(eng.store, a["id"], OPTS)  # sent, but the browser never drew it
    eng.steps(2)
    again = feed.payload(eng.store, a["id"], OPTS)  # it asks again from `a`
    assert _numbers(b) == [5, 6] and _numbers(again) == [5, 6, 7, 8]
    assert again["base"] == a["id"]
    # the encoder state was replayed from `a` as well: the same view model
    assert expand_columns(again["steps"])["stalled"][:2] == expand_columns(b["steps"])["stalled"]


def test_unknown_ids_wider_windows_resets_and_pauses() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.steps(120)
    a = feed.payload(eng.store, None, OPTS)
    assert feed.payload(eng.store, 999, OPTS)["reset"]  # a remounted view: start again
    wide = feed.payload(eng.store, a["id"], ViewOptions(window=100, xmode="step"))
    assert wide["reset"] and len(_numbers(wide)) == 100  # it needs steps it dropped
    paused = feed.payload(eng.store, wide["id"], ViewOptions(100, "step", paused=True))
    assert paused["paused"] and paused["id"] == wide["id"] and "steps" not in paused
    eng.steps(3)
    resumed = feed.payload(eng.store, wide["id"], ViewOptions(100, "step"))
    assert _numbers(resumed) == [120, 121, 122]  # resuming catches up from the store
    eng.store.clear()  # history replaced: the browser must drop what it drew
    cleared = feed.payload(eng.store, resumed["id"], ViewOptions(100, "step"))
    assert cleared["reset"] and _numbers(cleared) == []


def test_a_batch_is_bounded_by_the_window_even_after_a_long_pause() -> None:
    eng, feed = Engine(), LiveFeed()
    eng.steps(10)
    a = feed.payload(eng.store, None, OPTS)
    eng.steps(500)
    late = feed.payload(eng.store, a["id"], OPTS)
    assert late["reset"] and _numbers(late) == list(range(460, 510))
    assert np.all(np.diff(_numbers(late)) == 1)
