"""The dashboard's figure builders and derived numbers, on synthetic protocol messages."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go
import pytest

from app import figures
from app.derive import headline, stalls, step_axis, token_gaps, tracks
from app.figures import STALL_RED, request_color

Message = dict[str, Any]


def step(
    n: int,
    items: list[tuple[int, str, int, int]],
    *,
    budget: int = 16,
    dt: float = 0.1,
    kv: tuple[int, int, int, int, int] = (100, 10, 5, 85, 40),
    phase: str | None = None,
) -> Message:
    kinds = {k == "decode" for _, k, _, _ in items}
    if phase is None:
        phase = "mixed" if len(kinds) == 2 else ("decode" if True in kinds else "prefill")
    total, used, cached, free, reserved = kv
    return {
        "type": "step",
        "step": n,
        "t0": n * dt,
        "t1": (n + 1) * dt,
        "phase": phase,
        "budget": budget,
        "items": [{"uid": u, "kind": k, "start": a, "end": b} for u, k, a, b in items],
        "kv": {"total": total, "used": used, "cached": cached, "free": free, "reserved": reserved},
        "queue": {"waiting": 0, "running": 2},
    }


def request(uid: int, state: str = "finished", t_queued: float = 0.0, **extra: Any) -> Message:
    return {"uid": uid, "state": state, "t_queued": t_queued, **extra}


def chapter_steps() -> list[Message]:
    """The chapter's printed trace: budget 16, prompts of 61, 5 and 5 tokens, max_tokens=3."""
    return [
        step(0, [(0, "chunk", 0, 16)]),
        step(1, [(0, "chunk", 16, 32)]),
        step(2, [(0, "chunk", 32, 48)]),
        step(3, [(0, "prefill", 48, 61), (1, "chunk", 0, 3)]),
        step(4, [(1, "prefill", 3, 5), (2, "prefill", 0, 5)]),
        step(5, [(0, "decode", 61, 62), (1, "decode", 5, 6), (2, "decode", 5, 6)]),
        step(6, [(0, "decode", 62, 63), (1, "decode", 6, 7), (2, "decode", 6, 7)]),
    ]


def stall_steps() -> list[Message]:
    """Request 0 decodes, then request 1's 48-token prompt is chunked for three steps."""
    return [
        step(0, [(0, "prefill", 0, 8)]),
        step(1, [(0, "decode", 8, 9)]),
        step(2, [(1, "chunk", 0, 16)]),
        step(3, [(1, "chunk", 16, 32)]),
        step(4, [(1, "prefill", 32, 48)]),
        step(5, [(0, "decode", 9, 10), (1, "decode", 48, 49)]),
    ]


def trace(fig: go.Figure, name: str) -> Any:
    matches = [t for t in fig.data if t.name == name]
    assert len(matches) == 1, f"expected one trace named {name!r}, got {[t.name for t in fig.data]}"
    return matches[0]


def validated(fig: go.Figure) -> go.Figure:
    """`fig`, after checking that plotly's validation accepts it (the builders skip it)."""
    go.Figure(fig.to_dict())
    return fig


# ---- derived facts ------------------------------------------------------------------------------


def test_tracks_and_token_gaps_follow_sampling_items() -> None:
    steps = stall_steps()
    t = tracks(steps)
    assert t[0].token_steps == [0, 1, 5]
    assert t[1].chunks == [(2, "chunk", 0, 16), (3, "chunk", 16, 32), (4, "prefill", 32, 48)]
    g = token_gaps(steps, t[0])
    assert g.itl == pytest.approx([0.1, 0.4])
    assert g.stalled.tolist() == [False, True]


def test_stalls_include_a_trailing_one_only_while_running() -> None:
    steps = stall_steps()[:4]  # request 0 has not decoded again yet
    running = stalls(steps, tracks(steps), {0: {"state": "running"}})
    assert [(s.uid, s.first, s.last, s.ongoing) for s in running] == [(0, 2, 3, True)]
    assert running[0].seconds == pytest.approx(0.2)
    assert stalls(steps, tracks(steps), {0: {"state": "aborted"}}) == []


def test_headline_numbers() -> None:
    steps = stall_steps()
    reqs = [
        request(0, t_queued=0.0, t_first_token=0.1),
        request(1, t_queued=0.15, t_first_token=0.5),
    ]
    h = headline(steps, reqs)
    assert h.ttft_p50 == pytest.approx((0.1 + 0.35) / 2)
    assert h.worst_stall == pytest.approx(0.4)
    assert h.worst_stall_uid == 0
    assert h.itl_p50 == pytest.approx(np.percentile([0.1, 0.4, 0.1], 50))
    assert h.kv_used == pytest.approx(0.10) and h.kv_cached == pytest.approx(0.05)
    # 5 tokens sampled (steps 0, 1, 4 and two in 5) over 0.6 s of engine time
    assert h.tokens_per_s == pytest.approx(5 / 0.6)
    assert (h.running, h.waiting) == (2, 0)


def test_headline_without_stalls_reports_none() -> None:
    steps = chapter_steps()[4:]
    assert headline(steps, []).worst_stall is None


def test_time_axis_maps_queue_time_to_the_next_step() -> None:
    axis = step_axis(stall_steps(), "step")
    assert axis.x_at_time(0.25) == pytest.approx(3 - 0.45)  # queued during step 2
    assert step_axis(stall_steps(), "time").x_at_time(0.25) == 0.25


# ---- 1. batch composition ---------------------------------------------------------------------


def test_batch_figure_stacks_hatched_prompt_pieces_over_solid_decodes() -> None:
    steps = [step(0, [(1, "chunk", 0, 10), (0, "decode", 7, 8)], phase="mixed")]
    fig = figures.batch_figure(steps)
    prompt = trace(fig, "prompt chunk (hatched)")
    decode = trace(fig, "decode token (solid)")
    assert prompt.marker.pattern.shape == "/"
    assert decode.marker.pattern.shape == ""
    assert list(decode.y) == [1] and list(decode.base) == [0]
    assert list(prompt.y) == [10] and list(prompt.base) == [1]  # on top of the decode
    assert list(prompt.marker.color) == [request_color(1)]
    assert list(decode.marker.color) == [request_color(0)]
    assert list(prompt.customdata[0][:4]) == [1, "chunk", 0, 10]
    assert list(prompt.text) == ["req 1 [0:10)"] and prompt.textangle == -90


def test_batch_figure_draws_budget_line_phase_band_and_stall_marks() -> None:
    steps = stall_steps()
    steps[3]["budget"] = 32
    fig = validated(figures.batch_figure(steps, [request(0, "running"), request(1, "running")]))
    budget = trace(fig, "budget (max_extend_tokens)")
    assert list(budget.y) == [16, 16, 16, 16, 16, 16, 32, 32, 16, 16, 16, 16]
    assert list(budget.x[6:8]) == pytest.approx([3 - 0.45, 3 + 0.45])
    phase = trace(fig, "phase")
    assert list(phase.z[0]) == [0, 1, 0, 0, 0, 1]  # prefill, decode, prefill×3, decode
    assert [c[1] for c in phase.colorscale[::2]] == list(figures.PHASE_COLORS.values())
    stalled = trace(fig, "decode stalled")
    assert list(stalled.x) == [2, 3, 4]
    assert stalled.marker.color == STALL_RED
    assert all(y < 0 for y in stalled.y)  # under the bars


def test_batch_figure_keeps_a_far_budget_off_chart_but_says_so() -> None:
    steps = [step(0, [(0, "decode", 3, 4)], budget=8192)]
    fig = figures.batch_figure(steps)
    assert trace(fig, "budget (max_extend_tokens)").visible == "legendonly"
    assert "budget 8192" in fig.layout.annotations[0].text


def test_batch_figure_sums_per_kind_for_long_windows() -> None:
    n = figures.DETAIL_STEPS + 1
    steps = [step(i, [(0, "decode", i, i + 1), (1, "chunk", 0, 5)]) for i in range(n)]
    fig = figures.batch_figure(steps)
    decode = trace(fig, "decode tokens (all requests)")
    prompt = trace(fig, "prompt tokens (all requests, hatched)")
    assert len(decode.x) == n and set(decode.y) == {1} and set(prompt.y) == {5}
    assert set(prompt.base) == {1}


def test_batch_figure_time_axis_uses_step_durations() -> None:
    fig = figures.batch_figure(stall_steps(), x="time")
    decode = trace(fig, "decode token (solid)")
    assert decode.x[0] == pytest.approx(0.15)  # step 1 spans [0.1, 0.2]
    assert decode.width[0] == pytest.approx(0.09)
    assert fig.layout.xaxis.title.text == "engine time (s)"


# ---- 2. request lanes -------------------------------------------------------------------------


def test_lanes_label_every_chunk_with_its_range() -> None:
    fig = validated(figures.lanes_figure(chapter_steps(), [request(u) for u in range(3)]))
    chunks = trace(fig, "prompt chunk [start:end)")
    labels = list(zip(chunks.y, chunks.text, strict=True))
    assert labels == [
        ("req 0", "[0:16)"),
        ("req 0", "[16:32)"),
        ("req 0", "[32:48)"),
        ("req 0", "[48:61)"),
        ("req 1", "[0:3)"),
        ("req 1", "[3:5)"),
        ("req 2", "[0:5)"),
    ]
    assert chunks.marker.pattern.shape == "/"
    assert list(fig.layout.yaxis.categoryarray) == ["req 2", "req 1", "req 0"]


def test_lanes_mark_stalls_red_between_tokens() -> None:
    reqs = [request(0, "finished"), request(1, "finished")]
    fig = figures.lanes_figure(stall_steps(), reqs)
    stall = trace(fig, "stall (no token this step)")
    assert list(stall.y) == ["req 0"]
    # from the end of step 1 to the start of step 5: steps 2-4 had no token for request 0
    assert stall.base[0] == pytest.approx(1.45)
    assert stall.base[0] + stall.x[0] == pytest.approx(4.55)
    assert list(stall.marker.color) == [STALL_RED]
    assert "400 ms" in stall.customdata[0]


def test_lanes_merge_decode_runs_and_show_waiting() -> None:
    steps = [
        step(0, [(0, "prefill", 0, 4)]),
        step(1, [(0, "decode", 4, 5)]),
        step(2, [(0, "decode", 5, 6), (1, "prefill", 0, 3)]),
        step(3, [(0, "decode", 6, 7), (1, "decode", 3, 4)]),
    ]
    reqs = [request(0, t_queued=0.0), request(1, t_queued=0.05)]
    fig = figures.lanes_figure(steps, reqs)
    decode = trace(fig, "decoding")
    segments = zip(decode.y, decode.base, decode.x, strict=True)
    runs = {(y, round(b, 2), round(b + x, 2)) for y, b, x in segments}
    assert runs == {("req 0", 0.55, 3.45), ("req 1", 2.55, 3.45)}
    waiting = trace(fig, "waiting")
    # request 1 was queued during step 0, so it waits through step 1
    assert list(waiting.y) == ["req 1"]
    assert waiting.base[0] == pytest.approx(0.55) and waiting.x[0] == pytest.approx(1.0)


def test_lanes_show_a_queued_request_and_an_ongoing_stall() -> None:
    steps = stall_steps()[:4]
    reqs = [request(0, "running"), request(1, "running"), request(2, "waiting", t_queued=0.35)]
    fig = figures.lanes_figure(steps, reqs)
    stall = trace(fig, "stall (no token this step)")
    assert list(stall.y) == ["req 0"]
    assert stall.base[0] + stall.x[0] == pytest.approx(3.45)  # up to the last step so far
    assert "still waiting" in stall.customdata[0]
    assert "req 2" in list(trace(fig, "waiting").y)


def test_lanes_cap_the_number_of_requests() -> None:
    steps = [step(i, [(i, "prefill", 0, 2)]) for i in range(10)]
    fig = figures.lanes_figure(steps, [], max_lanes=4)
    assert list(fig.layout.yaxis.categoryarray) == ["req 9", "req 8", "req 7", "req 6"]


def test_timeline_shares_one_x_axis_between_batches_and_lanes() -> None:
    fig = validated(figures.timeline_figure(chapter_steps(), [request(u) for u in range(3)]))
    drawn = [t for t in fig.data if t.x is None or list(t.x) != [None]]  # not legend swatches
    assert {t.yaxis for t in drawn} == {"y", "y2"}
    assert {t.xaxis for t in drawn} <= {None, "x"}
    assert fig.layout.yaxis2.domain[1] < fig.layout.yaxis.domain[0]
    totals = np.zeros(7)
    for t in fig.data:
        if t.type == "bar" and t.yaxis == "y":
            for x, y in zip(t.x, t.y, strict=True):
                totals[int(round(x))] += y
    assert totals.tolist() == [16, 16, 16, 16, 7, 3, 3]


# ---- 3. KV pool -------------------------------------------------------------------------------


def test_kv_figure_stacks_to_the_pool_total_and_converts_reserved_to_pages() -> None:
    steps = [
        step(0, [(0, "chunk", 0, 4)], kv=(64, 4, 0, 60, 30)),
        step(1, [(0, "prefill", 4, 8)], kv=(64, 8, 2, 54, 27)),
    ]
    fig = validated(figures.kv_figure(steps, page_size=4))
    used, cached, free = (trace(fig, f"{k} pages") for k in ("used", "cached", "free"))
    assert {used.stackgroup, cached.stackgroup, free.stackgroup} == {"kv"}
    stacked = np.array(used.y) + np.array(cached.y) + np.array(free.y)
    assert stacked.tolist() == [64, 64]
    reserved = [t for t in fig.data if t.name.startswith("reserved")][0]
    assert list(reserved.y) == [math.ceil(30 / 4), math.ceil(27 / 4)]
    assert "page size 4" in reserved.name
    assert list(used.x) == [0.1, 0.2]  # time axis: each step's end
    assert fig.layout.yaxis.range[1] == pytest.approx(1.04 * 64)


def test_kv_figure_can_zoom_to_the_pages_in_use() -> None:
    steps = [step(0, [(0, "chunk", 0, 4)], kv=(20_000, 100, 50, 19_850, 40))]
    fig = figures.kv_figure(steps, whole_pool=False)
    assert fig.layout.yaxis.range[1] == pytest.approx(1.04 * int(1.3 * 150))


# ---- 4. decode progress -----------------------------------------------------------------------


def test_decode_progress_is_flat_and_red_during_chunks() -> None:
    steps = stall_steps()
    reqs = [request(0), request(1)]
    fig = validated(figures.decode_progress_figure(steps, reqs))
    total = trace(fig, "all requests")
    assert list(total.y) == [0, 1, 2, 2, 2, 3, 5]
    assert list(total.x) == pytest.approx([0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    band = trace(fig, "decode stalled")
    assert list(band.x) == pytest.approx([0.25, 0.35, 0.45])  # steps 2-4
    assert band.marker.color == STALL_RED
    req0 = trace(fig, "req 0")
    assert list(req0.y) == [1, 2, 3] and req0.line.color == request_color(0)


# ---- 5. inter-token latency -------------------------------------------------------------------


def test_itl_marks_stalls_red_and_labels_the_worst() -> None:
    fig = validated(figures.itl_figure(stall_steps(), [request(0), request(1)]))
    req0 = trace(fig, "req 0")
    assert list(req0.y) == pytest.approx([100, 400])
    assert list(req0.marker.color) == [request_color(0), STALL_RED]
    note = fig.layout.annotations[0]
    assert note.text == "worst stall: 400 ms · req 0"
    assert note.x == pytest.approx(0.6) and note.y == pytest.approx(400)


def test_itl_without_stalls_says_longest_gap() -> None:
    fig = figures.itl_figure(chapter_steps()[4:], [])
    assert fig.layout.annotations[0].text.startswith("longest gap (no stall)")
    assert STALL_RED not in list(trace(fig, "req 0").marker.color)


# ---- all builders -----------------------------------------------------------------------------

BUILDERS = {
    "batch": lambda s: figures.batch_figure(s, []),
    "lanes": lambda s: figures.lanes_figure(s, []),
    "timeline": lambda s: figures.timeline_figure(s, [], x="time"),
    "kv": lambda s: figures.kv_figure(s),
    "progress": lambda s: figures.decode_progress_figure(s, []),
    "itl": lambda s: figures.itl_figure(s, []),
}


@pytest.mark.parametrize("name", BUILDERS)
def test_every_builder_explains_an_empty_trace(name: str) -> None:
    fig = validated(BUILDERS[name]([]))
    assert "No engine steps recorded yet" in fig.layout.annotations[0].text


@pytest.mark.parametrize("name", BUILDERS)
def test_every_builder_makes_a_valid_figure_of_a_long_trace(name: str) -> None:
    from tests.app.app_peer import synthetic_trace

    steps = [m for m in synthetic_trace(2_000) if m["type"] == "step"]
    fig = validated(BUILDERS[name](steps))
    assert fig.data
