"""The delay on real runs of the tiny model: its parts add up to every request's latency under
both policies and both admission modes (retractions happening, with and without overlap); in
the chapter's case the chats' stalls are charged to the long prompt; and what a client receives
live (the publisher names each request's delay in its end event) is what a replay of the
recording, the page's fold, a late client's `hello` and the trace export compute."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from instrumentation import messages
from instrumentation.blame import request_gaps, who_delayed_whom, worst_stall_cause
from instrumentation.delay import Delay, delays_of
from instrumentation.fold import Fold
from instrumentation.metrics import stall_gaps
from instrumentation.protocol import ENDED_STATES, POLICY_NAMES
from instrumentation.publisher import Publisher, PublisherConfig
from instrumentation.trace import TraceWriter, read_jsonl, to_chrome_trace
from tests.server.test_server_support import ProtoClient

# one worker runs the module: its fixtures (a recorded run in every mode, the chapter's case)
# are made once, not by each worker that gets one of its tests
pytestmark = pytest.mark.xdist_group("delay_recordings")

Msg = dict[str, Any]
POOL = 64  # pages of one token: decodes run out of pages again and again under `optimistic`
PRESSURE = dict(schedule_conservativeness=0.3, new_token_ratio_decay_steps=3)
MODES = [("reserve", False), ("optimistic", False), ("optimistic", True)]  # (admission, overlap)


def _record(llm: LLM, waves: list[tuple[list[list[int]], list[int]]]) -> list[Msg]:
    """Every message of a run: each wave of requests is submitted, then a few steps run."""
    msgs: list[Msg] = [messages.hello(0.0, llm.info.to_dict(), llm.config_dict(), {})]

    def hook(event: Any) -> None:
        msgs.append(event.to_dict())

    llm.add_event_hook(hook)
    try:
        for prompts, outputs in waves:
            for p, n in zip(prompts, outputs, strict=True):
                llm.submit(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for _ in range(5):
                llm.step()
        while llm.has_work():
            llm.step()
    finally:
        llm.remove_event_hook(hook)
    return msgs


def _waves(seed: int) -> list[tuple[list[list[int]], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(3, 24))]
                   for _ in range(6)]  # fmt: skip
        out.append((prompts, [rng.randrange(8, 33) for _ in prompts]))
    return out


@pytest.fixture(scope="module")
def recordings(tiny_llama_dir: Path) -> dict[tuple[str, bool, str], list[Msg]]:
    out = {}
    for admission, overlap in MODES:
        llm = LLM(str(tiny_llama_dir), num_pages=POOL, max_running_req=12, max_seq_len=64,
                  max_extend_tokens=16, admission=admission, overlap=overlap, page_size=1,
                  cache_type="naive", progress=False, **PRESSURE)  # type: ignore[arg-type]  # fmt: skip
        for policy in POLICY_NAMES:
            llm.set_config(policy=policy)
            out[admission, overlap, policy] = _record(llm, _waves(7))
        llm.close()
    return out


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize(("admission", "overlap"), MODES)
def test_the_parts_add_up_to_every_requests_latency(
    recordings: dict, admission: str, overlap: bool, policy: str
) -> None:
    msgs = recordings[admission, overlap, policy]
    fold = Fold(max_steps=None, delays=True)
    for m in msgs:
        fold.apply(m)
    recs = fold.requests()
    assert len(recs) == 18 and all(r.state == "finished" for r in recs)
    for rec in recs:
        e2e = rec.metrics()["e2e_request_latency_seconds"]  # type: ignore[index]
        assert rec.delay is not None
        assert abs(rec.delay.total - e2e) < 1e-6, (rec.uid, rec.delay, e2e)
        gaps = request_gaps(fold, rec.uid)
        assert len(gaps) == rec.output_len
        for g in gaps:  # each wait, too, is split whole
            assert sum(c.seconds for c in g.charges) == pytest.approx(g.seconds, abs=1e-9)
    total = {k: sum(r.delay.parts()[k] for r in recs) for k in ("own", "by")}  # type: ignore[union-attr]
    assert total["own"] > 0 and total["by"] > 0
    waited = {r for rec in recs for r in rec.delay.queue}  # type: ignore[union-attr]
    assert "kv" in waited or "reserved" in waited  # the pool is small: requests wait for it
    if admission == "optimistic":  # retractions happened, and their recompute is named
        assert sum(len(m.get("retracted") or ()) for m in msgs if m["type"] == "step") > 0
        assert any(r.delay.retracted > 0 for r in recs)  # type: ignore[union-attr]
        assert any(r.retractions for r in recs)


# ---- the chapter's case: four chats decoding when a long prompt arrives --------------------
@pytest.fixture(scope="module")
def chapter(tiny_llama_dir: Path) -> dict[str, tuple[list[Msg], list[int], int]]:
    llm = LLM(str(tiny_llama_dir), max_running_req=8, cache_type="naive", page_size=1,
              progress=False)  # fmt: skip
    out = {}
    for policy in POLICY_NAMES:
        llm.set_config(policy=policy, max_extend_tokens=64)  # the chats start in one step
        msgs: list[Msg] = []

        def hook(event: Any, msgs: list[Msg] = msgs) -> None:
            msgs.append(event.to_dict())

        llm.add_event_hook(hook)
        chat = SamplingParams(max_tokens=24, ignore_eos=True)
        chats = [llm.submit([1000 + 17 * i + j for j in range(12)], chat) for i in range(4)]
        for _ in range(8):  # the chats are decoding
            llm.step()
        llm.set_config(max_extend_tokens=16)
        long = llm.submit([2000 + j % 3000 for j in range(1000)],
                          SamplingParams(max_tokens=4, ignore_eos=True))  # fmt: skip
        while llm.has_work():
            llm.step()
        llm.remove_event_hook(hook)
        out[policy] = (msgs, chats, long)
    llm.close()
    return out


def test_the_chats_stalls_are_charged_to_the_long_prompt(chapter: dict) -> None:
    """Prefill-first, a budget of 16: the long prompt's 63 chunks run while the chats wait. In
    each chat's stall (instrumentation.metrics' stall) every step before the one that decoded
    its token is charged whole to the long prompt; the rest is that decode step and the time
    between steps. (How the seconds divide follows the machine: on a loaded one a descheduled
    decode step took a sixth of a stall.)"""
    msgs, chats, long = chapter["prefill_first"]
    fold = Fold(max_steps=None, delays=True)
    for m in msgs:
        fold.apply(m)
    for uid in chats:
        rec = fold.get(uid)
        stalled = sum(stall_gaps(rec.token_times, rec.token_steps))  # type: ignore[union-attr]
        stalls = [g for g in request_gaps(fold, uid) if g.stall]
        assert stalled > 0 and sum(g.seconds for g in stalls) == pytest.approx(stalled)
        for g in stalls:
            assert g.first_step is not None and g.last_step is not None
            chunks = [c for c in g.charges if c.part == "by" and c.uid == long]
            covered = {n for c in chunks for n in range(c.first_step, c.last_step + 1)}
            assert sum(c.steps for c in chunks) == len(covered)  # runs of steps, none skipped
            assert covered == set(range(g.first_step, g.last_step)), g.describe()
            assert all(c.kind == "prompt" and c.seconds > 0 for c in chunks)
            rest = [c for c in g.charges if c.part != "host" and c not in chunks]
            assert rest and all(
                c.kind == "decode" and c.first_step == c.last_step == g.last_step for c in rest
            ), g.describe()
    cause = worst_stall_cause(fold)
    assert cause is not None and cause.uid in chats
    assert cause.phrase.endswith(f"mostly request {long}'s prompt"), cause.phrase
    assert who_delayed_whom(fold).pairs[0][0] == long


def test_under_mixed_the_chats_are_charged_only_what_the_chunks_added(chapter: dict) -> None:
    msgs, chats, long = chapter["mixed"]
    fold = Fold(max_steps=None, delays=True)
    for m in msgs:
        fold.apply(m)
    steps = [m for m in msgs if m["type"] == "step"]
    mixed_span = sum(s["t1"] - s["t0"] for s in steps if s["phase"] == "mixed")
    charged = 0.0
    for uid in chats:
        d = fold.get(uid).delay  # type: ignore[union-attr]
        assert fold.get(uid).max_stall is None  # type: ignore[union-attr]
        # never the whole mixed step: its decodes are own. A mixed step no slower than the
        # run's decode-only steps (instrumentation.step_cost) charges its chunk nothing: on a
        # loaded machine the decode-only steps' median can be that slow
        assert 0 <= d.by.get(long, 0.0) < mixed_span
        charged += d.by.get(long, 0.0)
    assert charged > 0


# ---- live, replay, the page, a late client, the trace export: one figure ----------------
def test_replay_equals_live(chapter: dict, tmp_path: Path) -> None:
    msgs, _, _ = chapter["prefill_first"]
    engine = {"model": "tiny", "instance": "x"}
    trace = TraceWriter(tmp_path / "run.jsonl")
    trace.write(json.dumps(messages.hello(0.0, engine, {}, {})))  # as the server's header
    history = Fold()  # the server's: no ledger of its own, it keeps what the end events carry
    pub = Publisher(
        PublisherConfig(port=0),
        hello=lambda: messages.hello(1.0, engine, {}, history.history(), history.seq),
        sinks=[lambda msg, _text: history.apply(msg), trace],
    )
    pub.start()
    try:
        client = ProtoClient(pub.url)
        stream = [m for m in msgs if m["type"] != "hello"]
        # as the engine's process hands them over: numbered and serialized
        frames = [json.dumps({**m, "seq": i}).encode() for i, m in enumerate(stream)]
        for k in range(0, len(frames), 7):
            pub.loop.call_soon_threadsafe(pub.publish_serialized, frames[k : k + 7])
        got = [client.recv() for _ in frames]
        late = ProtoClient(pub.url)
    finally:
        pub.stop()
        trace.close()
    live = {m["uid"]: m["delay"] for m in got
            if m["type"] == "request" and m["event"] in ENDED_STATES}  # fmt: skip
    assert len(live) == 5 and all(isinstance(d, dict) for d in live.values())
    recording = list(read_jsonl(tmp_path / "run.jsonl"))
    stripped = [{k: v for k, v in m.items() if k != "delay"} for m in recording]
    replayed = delays_of(stripped)
    assert {u: d.to_dict() for u, d in replayed.items()} == live
    page = Fold(max_steps=None, delays=True)
    for m in stripped:
        page.apply(m)
    assert {u: page.get(u).delay.to_dict() for u in live} == live  # type: ignore[union-attr]
    rows = {r["uid"]: r["delay"] for r in late.hello["history"]["requests"]}
    assert rows == live
    ended = [e for e in to_chrome_trace(recording)["traceEvents"] if e.get("name") == "finished"]
    assert {e["tid"]: e["args"]["delay"] for e in ended} == live
    assert Delay.from_dict(live[0]).total > 0
