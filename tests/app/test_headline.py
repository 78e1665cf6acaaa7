"""The page's metric row is the shared fold's Summary over the steps in view, and says which
steps those are."""

from __future__ import annotations

from typing import Any

import pytest

from app.derive import headline
from instrumentation.fold import summarize_steps

Message = dict[str, Any]


def step(n: int, items: list[tuple[int, str, int, int]], dt: float = 0.1) -> Message:
    return {
        "type": "step", "step": n, "t0": n * dt, "t1": (n + 1) * dt, "phase": "x", "budget": 16,
        "items": [{"uid": u, "kind": k, "start": a, "end": b} for u, k, a, b in items],
        "kv": {"total": 100, "used": 10, "cached": 5, "free": 85, "reserved": 0},
        "queue": {"waiting": 1, "running": 2},
    }  # fmt: skip


STEPS = [
    step(0, [(0, "prefill", 0, 8)]),
    step(1, [(0, "decode", 8, 9)]),
    step(2, [(1, "chunk", 0, 16)]),
    step(3, [(1, "chunk", 16, 32)]),
    step(4, [(1, "prefill", 32, 48)]),
    step(5, [(0, "decode", 9, 10), (1, "decode", 48, 49)]),
]
REQUESTS = [
    {"uid": 0, "state": "running", "t_queued": 0.0, "t_first_token": 0.1},
    {"uid": 1, "state": "running", "t_queued": 0.15, "t_first_token": 0.5},
]


def test_the_row_is_the_summary_of_the_steps_given() -> None:
    h = headline(STEPS, REQUESTS)
    s = summarize_steps(STEPS, REQUESTS)
    assert h.summary == s
    assert (h.ttft_p50, h.ttft_p99, h.itl_p50, h.itl_p99, h.itl_p999) == (
        s.ttft_p50_s, s.ttft_p99_s, s.itl_p50_s, s.itl_p99_s, s.itl_p999_s,
    )  # fmt: skip
    assert (h.worst_stall, h.worst_stall_uid) == (s.worst_stall_s, 0)
    assert h.worst_stall == pytest.approx(0.6 - 0.2)  # steps 2-4 ran without request 0
    assert h.tokens_per_s == s.output_tok_s == pytest.approx(5 / 0.6)
    # running / waiting as the request records stand now, not as the last step saw them
    assert (h.kv_used, h.kv_cached, h.running, h.waiting) == (0.10, 0.05, 2, 0)


def test_the_row_says_what_it_covers() -> None:
    assert headline(STEPS, REQUESTS).scope == "the whole run (steps 0–5)"
    window = headline(STEPS[2:], REQUESTS)
    assert window.scope == "the 4 steps in view (steps 2–5)"
    assert window.worst_stall is None  # request 0's tokens around its stall are not both in view
    assert window.ttft_p50 == pytest.approx(0.5 - 0.15)  # only request 1's first token is in view
    recording = headline(STEPS[2:], REQUESTS, whole=True)
    assert recording.scope == "the whole recording (steps 2–5)"
    assert headline(STEPS[2:], REQUESTS, whole=False).scope.startswith("the 4 steps in view")
    assert headline([], REQUESTS).scope == "no steps yet"


def test_a_stall_not_yet_ended_is_shown_as_stalled_now() -> None:
    """Mid-prompt under prefill-first: request 0 has been left out since step 1. No token has
    ended the gap yet, but it is the worst stall so far, and the row says it is still going."""
    h = headline(STEPS[:4], REQUESTS)
    assert h.summary.worst_stall_s is None  # the fold's ended stalls: none yet
    assert h.stalled_now == 1 and h.stalled_now_s == pytest.approx(0.4 - 0.2)
    assert (h.worst_stall, h.worst_stall_uid) == (h.stalled_now_s, 0)
    done = headline(STEPS, REQUESTS)
    assert done.stalled_now == 0 and done.stalled_now_s is None


def test_a_retracted_request_waiting_for_its_next_token_is_stalled() -> None:
    """Retracted, a request is back in the queue with its tokens kept: every step that runs
    without it is a stall in progress, shown in the row (it was "worst stall: none")."""
    retracted = [{**REQUESTS[0], "state": "waiting", "output_len": 2}, REQUESTS[1]]
    h = headline(STEPS[:4], retracted)
    assert h.stalled_now == 1 and (h.worst_stall, h.worst_stall_uid) == (h.stalled_now_s, 0)
    assert (h.running, h.waiting) == (1, 1)


def test_an_idle_engine_shows_the_pool_and_queue_after_its_last_request_ended() -> None:
    """No step follows the last request's end: the row reads the pool from the end event
    (`kv_after`) and the counts from the records, not from the last step."""
    empty = {"total": 100, "used": 0, "cached": 12, "free": 88, "reserved": 0}
    ended = [
        {
            **r,
            "state": "finished",
            "t_finished": STEPS[-1]["t1"],
            "kv_after": empty if r["uid"] else None,
        }
        for r in REQUESTS
    ]
    h = headline(STEPS, ended)
    assert (h.running, h.waiting, h.kv_used, h.kv_cached) == (0, 0, 0.0, 0.12)
    # a step after the end event is newer than it
    later = [*STEPS, step(6, [(2, "prefill", 0, 4)])]
    assert headline(later, ended).kv_used == 0.10
