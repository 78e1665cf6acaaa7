"""The headline `Summary`: one computation for a whole recording (`summarize`, `Fold.summary`)
and for a window of its steps (`summarize_steps`, what the page has in view)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from instrumentation.fold import Fold, summarize, summarize_steps
from instrumentation.metrics import max_stall, percentile, request_metrics, stall_gaps

Message = dict[str, Any]


def stream() -> list[Message]:
    """Request 0 decodes; request 1's 24-token prompt is chunked under prefill-first (budget 8)
    while 0 waits, then both decode. Steps take 0.1 s, the chunk steps 0.3 s."""
    msgs: list[Message] = [
        {"type": "request", "uid": 0, "event": "queued", "t": 0.0, "prompt_len": 4,
         "max_tokens": 4},
        {"type": "request", "uid": 1, "event": "queued", "t": 0.15, "prompt_len": 24,
         "max_tokens": 3},
    ]  # fmt: skip
    plan = [  # (items, seconds)
        ([(0, "prefill", 0, 4)], 0.1),
        ([(0, "decode", 4, 5)], 0.1),
        ([(1, "chunk", 0, 8)], 0.3),
        ([(1, "chunk", 8, 16)], 0.3),
        ([(1, "prefill", 16, 24)], 0.3),
        ([(0, "decode", 5, 6), (1, "decode", 24, 25)], 0.1),
        ([(0, "decode", 6, 7), (1, "decode", 25, 26)], 0.1),
    ]
    t = 0.0
    counts = {0: 0, 1: 0}
    for n, (items, dt) in enumerate(plan):
        t0, t = t, round(t + dt, 6)
        msgs.append({"type": "step", "step": n, "t0": t0, "t1": t, "phase": "x", "budget": 8,
                     "items": [{"uid": u, "kind": k, "start": a, "end": b}
                               for u, k, a, b in items]})  # fmt: skip
        ends = []
        for uid, kind, _, _ in items:
            if kind == "chunk":  # a prompt piece that does not finish it samples nothing
                continue
            msgs.append({"type": "token", "uid": uid, "t": t, "token_id": 5, "text": "x"})
            counts[uid] += 1
            if counts[uid] == 1:
                ends.append({"type": "request", "uid": uid, "event": "first_token", "t": t})
            if counts[uid] == (4 if uid == 0 else 3):
                ends.append({"type": "request", "uid": uid, "event": "finished", "t": t,
                             "output_len": counts[uid], "finish_reason": "length"})  # fmt: skip
        msgs.extend(ends)
    return msgs


def folded(msgs: list[Message]) -> Fold:
    fold = Fold(max_steps=None)
    for m in msgs:
        fold.apply(m)
    return fold


def test_a_window_of_every_step_is_the_whole_recording() -> None:
    msgs = stream()
    fold = folded(msgs)
    whole = summarize(msgs)
    assert whole == fold.summary()
    records = [r.to_dict(metrics=False) for r in fold.requests()]
    window = summarize_steps(list(fold.steps), records)
    assert asdict(window) == asdict(whole)
    assert (whole.steps, whole.first_step, whole.last_step) == (7, 0, 6)
    # request 0 waited through the three steps of request 1's prompt: 0.2 -> 1.2
    assert whole.worst_stall_uid == 0 and whole.worst_stall_s == pytest.approx(1.0)
    itls = [0.1, 1.0, 0.1, 0.1, 0.1]
    assert whole.itl_p999_s == pytest.approx(percentile(itls, 99.9))
    assert whole.ttft_p50_s == pytest.approx((0.1 + (1.1 - 0.15)) / 2)


def test_a_window_counts_what_happened_in_it() -> None:
    msgs = stream()
    fold = folded(msgs)
    records = [r.to_dict(metrics=False) for r in fold.requests()]
    tail = summarize_steps(list(fold.steps)[4:], records)  # steps 4-6
    assert (tail.steps, tail.first_step, tail.last_step) == (3, 4, 6)
    assert tail.worst_stall_s is None  # its two tokens are not both in the window
    assert tail.ttft_p50_s == pytest.approx(1.1 - 0.15)  # request 1's first token is in it
    assert tail.output_tokens == 5 and tail.prompt_tokens == 8
    assert tail.duration_s == pytest.approx(0.5)


def test_the_stall_rule_in_one_place() -> None:
    times, steps = [0.1, 0.2, 1.2, 1.3], [0, 1, 5, 6]
    assert list(stall_gaps(times, steps)) == pytest.approx([1.0])
    assert max_stall(times, steps) == pytest.approx(1.0)
    assert max_stall([0.1, 2.0], [0, 1]) is None  # a slow step that included it
    m = request_metrics(0.0, 0.0, [0.1, 2.0], [0, 1])
    assert m["max_stall_seconds"] is None and m["max_itl_seconds"] == pytest.approx(1.9)
    with pytest.raises(ValueError, match="token steps"):
        max_stall([0.1, 0.2], [0])
