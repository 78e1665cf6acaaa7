"""The delay's rules on small hand-made streams, where every figure is known exactly: a step
without the request is charged to its pieces, a mixed step only beyond its decodes' cost, a
prompt piece by tokens, waiting by the step's reason, a recompute to `retracted`, gaps between
steps to `host`, an arrival while a step runs to that step; the parts add up to the latency; the
page's views (instrumentation.blame) say so in words."""

from __future__ import annotations

from typing import Any

import pytest

from instrumentation.blame import (
    blame,
    request_gaps,
    step_interference,
    who_delayed_whom,
    worst_stall_cause,
)
from instrumentation.delay import Delay, DelayLedger, delays_of
from instrumentation.fold import Fold
from instrumentation.step_cost import DecodeEstimate

Msg = dict[str, Any]


def step(n: int, t0: float, t1: float, items: list[tuple], reason: str | None = None,
         retracted: tuple[int, ...] = ()) -> Msg:  # fmt: skip
    msg: Msg = {
        "type": "step", "step": n, "t0": t0, "t1": t1,
        "items": [{"uid": u, "kind": k, "start": a, "end": b, **({"sample": True} if s else {})}
                  for u, k, a, b, *s in items],
        "queue": {"waiting": 0, "running": 0, "waiting_reason": reason},
    }  # fmt: skip
    if retracted:
        msg["retracted"] = list(retracted)
    return msg


def queued(uid: int, t: float) -> Msg:
    return {"type": "request", "uid": uid, "event": "queued", "t": t, "prompt_len": 4}


def token(uid: int, t: float) -> Msg:
    return {"type": "token", "uid": uid, "t": t, "token_id": 1, "text": "x"}


def end(uid: int, t: float, event: str = "finished") -> Msg:
    return {"type": "request", "uid": uid, "event": event, "t": t}


def decoding(n: int, t0: float, dt: float, uids: tuple[int, ...], lengths: int = 10) -> list[Msg]:
    """A decode step of `uids` from t0 to t0 + dt, and its tokens."""
    s = step(n, t0, t0 + dt, [(u, "decode", lengths + n, lengths + n + 1) for u in uids])
    return [s, *(token(u, t0 + dt) for u in uids)]


def fold_all(msgs: list[Msg]) -> Fold:
    fold = Fold(max_steps=None, delays=True)
    for m in msgs:
        fold.apply(m)
    return fold


def check_conserved(fold: Fold) -> None:
    for rec in fold.requests():
        m = rec.metrics()
        assert rec.delay is not None and m is not None
        assert rec.delay.total == pytest.approx(m["e2e_request_latency_seconds"], abs=1e-9)


def prefill_first_stream() -> list[Msg]:
    """Chats 0 and 1 decode (10 ms steps, 1 ms apart); request 2's prompt of 300 tokens arrives
    and is chunked 3 x 100 under prefill_first (50 ms a chunk); the chats decode again."""
    msgs = [queued(0, 0.0), queued(1, 0.0)]
    msgs += [step(0, 0.0, 0.010, [(0, "prefill", 0, 10), (1, "prefill", 0, 10)]),
             token(0, 0.010), token(1, 0.010)]  # fmt: skip
    t = 0.011
    for n in (1, 2):
        msgs += decoding(n, t, 0.010, (0, 1))
        t += 0.011
    msgs.append(queued(2, t - 0.0005))
    for n, (a, b) in zip((3, 4, 5), ((0, 100), (100, 200), (200, 300)), strict=True):
        kind = "prefill" if b == 300 else "chunk"
        msgs.append(step(n, t, t + 0.050, [(2, kind, a, b)]))
        t += 0.051
    msgs.append(token(2, t - 0.001))
    msgs.append(end(2, t - 0.001))
    for n in (6, 7):
        msgs += decoding(n, t, 0.010, (0, 1))
        t += 0.011
    msgs += [end(0, t - 0.001), end(1, t - 0.001)]
    return msgs


def test_prefill_first_charges_the_chunk_steps_to_their_prompt() -> None:
    fold = fold_all(prefill_first_stream())
    check_conserved(fold)
    d = fold.get(0).delay
    # three 50 ms chunk steps, whole; half of the first step, which prefilled both chats
    assert d.by == {1: pytest.approx(0.005), 2: pytest.approx(0.150)}
    assert d.own == pytest.approx(0.005 + 0.010 * 4)  # its half, and four decode steps
    assert d.host == pytest.approx(0.001 * 7)  # the 1 ms between steps
    assert d.queue == {} and d.retracted == 0
    long = fold.get(2).delay
    assert long.own == pytest.approx(0.150) and long.by == {}
    # queued half a ms before its first step; 1 ms between its chunks
    assert long.host == pytest.approx(0.0025)
    gaps = request_gaps(fold, 0)
    stall = next(g for g in gaps if g.stall)
    assert stall.describe() == (
        "164 ms: 150 ms request 2's prompt [0:300] in steps 3–5, 10 ms own decode in step 6, "
        "4 ms between steps in steps 3–6"
    )
    cause = worst_stall_cause(fold)
    assert cause is not None and cause.uid in (0, 1)
    assert cause.phrase == "164 ms — mostly request 2's prompt"
    b = who_delayed_whom(fold)
    assert b.pairs[0][:2] in ((2, 0), (2, 1)) and b.by_culprit[2] == pytest.approx(0.3)
    assert b.latency == pytest.approx(sum(r.delay.total for r in fold.requests()))


def test_mixed_charges_only_what_the_prompt_added_to_the_decodes() -> None:
    """Decode-only steps of two decodes take 10 ms; a mixed step with a 98-token chunk takes 40:
    each chat's own is 10 ms of it, 30 ms is the chunk's. The chunk's own request is charged by
    tokens: 98 of 100."""
    msgs = [queued(0, 0.0), queued(1, 0.0),
            step(0, 0.0, 0.010, [(0, "prefill", 0, 10), (1, "prefill", 0, 10)]),
            token(0, 0.010), token(1, 0.010)]  # fmt: skip
    t = 0.010
    for n in (1, 2, 3):
        msgs += decoding(n, t, 0.010, (0, 1))
        t += 0.010
    msgs.append(queued(2, t))
    msgs.append(step(4, t, t + 0.040, [(0, "decode", 13, 14), (1, "decode", 13, 14),
                                       (2, "prefill", 0, 98)]))  # fmt: skip
    t += 0.040
    msgs += [token(0, t), token(1, t), token(2, t), end(0, t), end(1, t), end(2, t)]
    fold = fold_all(msgs)
    check_conserved(fold)
    chat = fold.get(0).delay
    assert chat.by == {1: pytest.approx(0.005), 2: pytest.approx(0.030)}
    assert chat.own == pytest.approx(0.005 + 0.010 * 3 + 0.010)
    long = fold.get(2).delay
    assert long.own == pytest.approx(0.040 * 98 / 100)
    assert long.by == {0: pytest.approx(0.0004), 1: pytest.approx(0.0004)}


def test_waiting_is_charged_to_the_reason_and_a_recompute_to_retracted() -> None:
    """Request 1 waits two steps behind the budget and one behind the pool; request 0 is
    retracted (its wait is `kv`) and recomputes its 12 tokens before its next one, charged by
    tokens in a step shared with request 1's decode."""
    msgs = [queued(0, 0.0), queued(1, 0.0),
            step(0, 0.0, 0.010, [(0, "prefill", 0, 10)], reason="budget"), token(0, 0.010),
            step(1, 0.010, 0.020, [(0, "decode", 10, 11)], reason="budget"), token(0, 0.020),
            step(2, 0.020, 0.030, [(0, "decode", 11, 12)], reason="kv"), token(0, 0.030),
            step(3, 0.030, 0.045, [(1, "prefill", 0, 8)], reason="kv", retracted=(0,)),
            token(1, 0.045),
            step(4, 0.045, 0.060, [(0, "recompute", 0, 12, True), (1, "decode", 8, 9)]),
            token(0, 0.060), token(1, 0.060), end(0, 0.060), end(1, 0.060)]  # fmt: skip
    fold = fold_all(msgs)
    check_conserved(fold)
    d1 = fold.get(1).delay
    assert d1.queue == {"budget": pytest.approx(0.020), "kv": pytest.approx(0.010)}
    # its prefill; then its decode as a decode-only step of one costs (10 ms), and the rest of
    # that step is request 0's recompute
    assert d1.own == pytest.approx(0.015 + 0.010)
    assert d1.by == {0: pytest.approx(0.005)}
    d0 = fold.get(0).delay
    assert d0.queue == {"kv": pytest.approx(0.015)}  # retracted when step 3 was scheduled
    assert d0.retracted == pytest.approx(0.015 * 12 / 13)
    assert d0.by == {1: pytest.approx(0.015 / 13)}
    wait = request_gaps(fold, 0)[-1]
    assert wait.waited == pytest.approx(0.015)
    assert "waiting (kv) in step 3" in wait.describe()


def test_an_arrival_while_a_step_runs_waits_for_that_steps_work() -> None:
    """With overlap a request can be queued after a step was scheduled, its `queued` event
    coming after that step's record: the rest of that step is charged to the step's pieces."""
    msgs = [queued(0, 0.0), step(0, 0.0, 0.010, [(0, "prefill", 0, 64)]), token(0, 0.010),
            queued(1, 0.004),  # applied while step 0 ran, reported after its record
            step(1, 0.006, 0.020, [(0, "decode", 64, 65), (1, "prefill", 0, 4)]),
            token(0, 0.020), token(1, 0.020), end(0, 0.020), end(1, 0.020)]  # fmt: skip
    fold = fold_all(msgs)
    check_conserved(fold)
    d1 = fold.get(1).delay
    # 6 ms of step 0 (request 0's prefill), then step 1's 10 ms span by tokens: 4 of 5 its own
    assert d1.by == {0: pytest.approx(0.006 + 0.010 / 5)}
    assert d1.own == pytest.approx(0.010 * 4 / 5) and d1.host == 0


def test_a_request_that_ends_without_a_token_is_covered_to_its_last_step() -> None:
    msgs = [queued(0, 0.0), queued(1, 0.0),
            step(0, 0.0, 0.010, [(0, "chunk", 0, 16)], reason="budget"),
            end(1, 0.011, "aborted"), end(0, 0.011, "aborted")]  # fmt: skip
    d = delays_of(msgs)
    assert d[1].queue == {"budget": 0.010} and d[0].own == 0.010


def test_delay_round_trips_as_the_protocol_object() -> None:
    d = Delay(0.5, 0.1, 0.01, {"kv": 0.2}, {4: 1.25})
    assert d.to_dict() == {"own": 0.5, "retracted": 0.1, "host": 0.01, "queue": {"kv": 0.2},
                           "by": {"4": 1.25}}  # fmt: skip
    assert Delay.from_dict(d.to_dict()) == d
    assert d.parts() == {"own": 0.5, "retracted": 0.1, "host": 0.01, "queue:kv": 0.2, "by": 1.25}
    b = blame({7: d})
    assert b.pairs == ((4, 7, 1.25),) and b.latency == pytest.approx(d.total)


def test_the_decode_estimate_is_a_median_interpolated_between_batch_sizes() -> None:
    est = DecodeEstimate()
    assert est(4) is None
    for s in (0.010, 0.011, 0.050, 0.012, 0.010):  # one outlier: the median ignores it
        est.add(2, s)
    for s in (0.020, 0.020, 0.021):
        est.add(6, s)
    assert est(2) == 0.011
    assert est(4) == pytest.approx((0.011 + 0.020) / 2)  # between known sizes
    assert est(10) > 0.020  # beyond them: a line through the medians
    assert est.bucket(64) == est.bucket(60) != est.bucket(16)


def test_the_ledger_calls_on_token_with_the_prompt_work_before_each_token() -> None:
    waits = []
    ledger = DelayLedger(on_token=waits.append)
    for m in prefill_first_stream():
        ledger.apply(m)
    chat = [w for w in waits if w.uid == 0]
    assert [w.index for w in chat] == list(range(5))
    # the first token waited for half of a step that prefilled the other chat too
    assert [round(w.by_prompt, 6) for w in chat] == [0.005, 0, 0, 0.15, 0]
    assert chat[3].seconds == pytest.approx(0.164)


def test_watched_steps_say_what_the_prompt_added_to_the_decodes() -> None:
    steps = [
        {"step": 0, "t0": 0.0, "t1": 0.020, "phase": "decode", "decode_requests": 4},
        {"step": 1, "t0": 0.020, "t1": 0.040, "phase": "decode", "decode_requests": 4},
        {"step": 2, "t0": 0.040, "t1": 0.100, "phase": "mixed", "decode_requests": 4,
         "prompt_tokens": 512},
        {"step": 3, "t0": 0.100, "t1": 0.100, "phase": "prefill", "prompt_tokens": 512},
    ]  # fmt: skip
    got = step_interference(steps)
    assert [g.added for g in got[:3]] == [0.0, 0.0, pytest.approx(0.040)]
    assert got[2].decode_alone == pytest.approx(0.020) and "names no request" in got[2].note
    assert got[3].added is None and "no time of its own" in got[3].note
