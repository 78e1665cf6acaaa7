"""The fold with the server's bounds (its `hello` history): bounded step history, every live request, latency metrics from events."""

from __future__ import annotations

from typing import Any

import pytest

from instrumentation import messages
from instrumentation.fold import Fold
from instrumentation.records import (
    KVStats,
    QueueStats,
    RequestEvent,
    StepItem,
    StepRecord,
    TokenEvent,
)
from tests.server.test_server_support import child_env

KV = KVStats(total=100, used=0, cached=0, free=100, reserved=0)


def step(n: int, items: tuple[StepItem, ...] = ()) -> dict[str, Any]:
    phase = "decode" if items and all(i.kind == "decode" for i in items) else "prefill"
    rec = StepRecord(n, n * 0.1, n * 0.1 + 0.05, phase, 16, "prefill_first", items, KV,
                     QueueStats(0, len(items)))  # fmt: skip
    return rec.to_dict()


def req(uid: int, event: str, t: float, **fields: Any) -> dict[str, Any]:
    return RequestEvent(uid, event, t, fields).to_dict()  # type: ignore[arg-type]


def tok(uid: int, t: float, text: str) -> dict[str, Any]:
    return TokenEvent(uid, t, 7, text).to_dict()


def lifecycle(r: Fold, uid: int, t: float, pieces: list[str], gap: float = 0.1) -> None:
    r.apply(req(uid, "queued", t, prompt_len=5, max_tokens=len(pieces)))
    r.apply(req(uid, "admitted", t + 0.5, cached_len=2))
    for k, piece in enumerate(pieces):
        r.apply(tok(uid, t + 1.0 + k * gap, piece))
        if k == 0:
            r.apply(req(uid, "first_token", t + 1.0))
    r.apply(
        req(uid, "finished", t + 1.0 + (len(pieces) - 1) * gap, output_len=len(pieces),
            finish_reason="length", text="".join(pieces))
    )  # fmt: skip


def test_keeps_the_last_steps_oldest_first() -> None:
    r = Fold(max_steps=2000)
    for n in range(2500):
        r.apply(step(n))
    steps = r.history()["steps"]
    assert len(steps) == 2000 and r.num_steps == 2500
    assert [s["step"] for s in steps] == list(range(500, 2500))


def test_request_record_and_metrics() -> None:
    r = Fold()
    lifecycle(r, 3, 10.0, [" Paris", ".", "!"], gap=0.25)
    (row,) = r.history()["requests"]
    assert row["uid"] == 3 and row["state"] == "finished"
    assert (row["prompt_len"], row["cached_len"], row["output_len"], row["max_tokens"]) == (
        5, 2, 3, 3,
    )  # fmt: skip
    assert row["t_queued"] == 10.0 and row["t_first_token"] == 11.0
    assert row["t_finished"] == pytest.approx(11.5) and row["text"] == " Paris.!"
    assert row["finish_reason"] == "length"
    m = row["metrics"]
    assert m["queue_time_seconds"] == pytest.approx(0.5)
    assert m["time_to_first_token_seconds"] == pytest.approx(1.0)
    assert m["inter_token_latency_seconds"] == pytest.approx([0.25, 0.25])
    assert m["max_stall_seconds"] is None  # no step ran without it: slow, never stalled
    assert m["e2e_request_latency_seconds"] == pytest.approx(1.5)


def test_live_request_shows_partial_text_and_state() -> None:
    r = Fold()
    r.apply(req(1, "queued", 0.0, prompt_len=4, max_tokens=8))
    assert r.history()["requests"][0]["state"] == "waiting"
    r.apply(req(1, "admitted", 0.1, cached_len=0))
    r.apply(tok(1, 0.2, "Hel"))
    r.apply(tok(1, 0.3, "lo"))
    row = r.history()["requests"][0]
    assert (row["state"], row["text"], row["output_len"], row["t_last_token"]) == (
        "running", "Hello", 2, 0.3,
    )  # fmt: skip


def test_ended_requests_are_bounded_but_live_ones_never_dropped() -> None:
    r = Fold(max_ended=10)
    r.apply(req(999, "queued", 0.0, prompt_len=1, max_tokens=1))  # stays live throughout
    for uid in range(50):
        lifecycle(r, uid, float(uid), ["a"])
    r.apply(req(40, "aborted", 100.0))  # late duplicate for an ended uid changes nothing
    uids = [row["uid"] for row in r.history()["requests"]]
    assert uids == [*range(40, 50), 999]
    assert r.get(40) is not None and r.get(40).state == "finished"  # type: ignore[union-attr]
    assert r.get(3) is None


def test_aborted_and_rejected_end_states() -> None:
    r = Fold()
    r.apply(req(1, "queued", 0.0, prompt_len=1, max_tokens=1))
    r.apply(req(1, "aborted", 0.5))
    r.apply(req(2, "queued", 0.0, prompt_len=1, max_tokens=1))
    r.apply(req(2, "rejected", 0.6, message="pool too small"))
    rows = {row["uid"]: row for row in r.history()["requests"]}
    assert rows[1]["state"] == "aborted" and rows[1]["t_finished"] == 0.5
    assert rows[2]["state"] == "rejected" and rows[2]["message"] == "pool too small"
    assert rows[1]["metrics"] is None
    summary = r.summary()
    assert (summary.aborted, summary.rejected, summary.finished) == (1, 1, 0)


def test_config_messages_update_config() -> None:
    r = Fold(config={"max_extend_tokens": 256, "policy": "prefill_first"})
    r.apply(messages.config("c1", 1.0, {"max_extend_tokens": 64, "policy": "mixed"}))
    assert r.config == {"max_extend_tokens": 64, "policy": "mixed"}


def test_a_client_fold_continues_from_hello() -> None:
    server = Fold()
    lifecycle(server, 0, 0.0, ["x", "y"])
    server.apply(step(1, (StepItem(0, "prefill", 0, 5),)))
    server.apply(req(1, "queued", 1.0, prompt_len=3, max_tokens=4))
    server.apply(req(1, "admitted", 1.1, cached_len=0))
    server.apply(tok(1, 1.2, "ab"))
    hello = messages.hello(2.0, {}, {"policy": "mixed"}, server.history())

    client = Fold()
    client.apply(hello)
    assert client.history() == server.history() and client.config == {"policy": "mixed"}
    for r in (server, client):
        r.apply(tok(1, 1.3, "cd"))
        r.apply(req(1, "finished", 1.3, output_len=2, finish_reason="eos", text="abcd"))
    done = client.get(1)
    assert done is not None and done.state == "finished" and done.text == "abcd"
    assert client.history()["requests"][1]["output_len"] == 2


def test_instrumentation_imports_no_torch() -> None:
    """The dashboard reuses these modules in a process that must not load torch."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "import instrumentation.commands, instrumentation.messages, instrumentation.publisher\n"
        "import instrumentation.fold, instrumentation.metrics, instrumentation.trace\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, env=child_env()
    )
    assert out.returncode == 0, out.stderr


def test_ended_requests_are_bounded_by_bytes_and_their_metrics_computed_once() -> None:
    r = Fold(max_ended=10_000, max_ended_bytes=200_000)
    for uid in range(400):
        lifecycle(r, uid, float(uid), ["tok"] * 50, gap=0.01)
    kept = [rec for rec in r.requests() if rec.ended]
    # each keeps 50 token times and its text: the byte budget, not the count, bounds them
    assert 0 < len(kept) < 400 and r.ended_bytes <= 200_000
    assert [rec.uid for rec in kept] == list(range(400 - len(kept), 400))  # the newest
    rec = kept[-1]
    assert rec.pieces == [] and rec.text == "tok" * 50  # the pieces are joined once
    first = rec.metrics()
    assert first is not None and rec.metrics() is first  # computed when it ended, not per hello


def test_fold_stall_is_a_gap_that_skipped_steps() -> None:
    """As the protocol sends them: each step, then its tokens. A slow step that included the
    request makes a long gap (max_itl_seconds), not a stall; steps that ran without it do."""
    r = Fold()
    r.apply(req(0, "queued", 0.0, prompt_len=5, max_tokens=4))
    r.apply(req(0, "admitted", 0.0, cached_len=0))
    prefill = (StepItem(0, "prefill", 0, 5),)
    decode = (StepItem(0, "decode", 5, 6),)
    stream = [
        step(0, prefill), tok(0, 0.05, "a"),
        step(1, decode), tok(0, 0.15, "b"),  # in consecutive steps: no stall
        step(2, (StepItem(1, "chunk", 0, 16),)),
        step(3, (StepItem(1, "chunk", 16, 32),)),
        step(4, decode), tok(0, 0.45, "c"),  # steps 2 and 3 ran without it
        step(5, decode), tok(0, 1.95, "d"),  # a slow step (its t1 made late): no stall
    ]  # fmt: skip
    for msg in stream:
        r.apply(msg)
    rec = r.get(0)
    assert rec is not None and rec.token_steps == [0, 1, 4, 5]
    m = rec.metrics()
    assert m is not None and m["max_stall_seconds"] == pytest.approx(0.45 - 0.15)
    assert m["max_itl_seconds"] == pytest.approx(1.95 - 0.45)
    s = r.summary()
    assert s.worst_stall_uid == 0 and s.worst_stall_s == pytest.approx(0.3)
    assert (s.steps, s.first_step, s.last_step) == (6, 0, 5)
