"""Honest step times and data-parallel engines.

vLLM lines here are built from vLLM 0.32's format string (`vllm/v1/metrics/loggers.py`,
`LoggingStatLogger._log_iteration_details`): "%sIteration(%d): %d context requests, %d context
tokens, %d generation requests, %d generation tokens, iteration elapsed time: %.2f ms%s, %s KV
cache usage: %.1f%%%s", with the prefix "Engine %03d: " and the default log format
"(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [...]"; no public thread shows
data-parallel 0.32 lines yet.
"""

from __future__ import annotations

from collections import Counter

import pytest

from instrumentation.watch.aggregate import AggregateStep
from instrumentation.watch.logclock import LogClock, parse_month_day, parse_stamp
from instrumentation.watch.placement import StepPlacer, spread
from instrumentation.watch.vllm_log import VllmLogReader


def vllm_line(
    engine: int, it: int, stamp: str, ctx: int = 0, gen: int = 4, ms: float = 20.0,
    dummy: bool = False, device: str = "GPU", proc: str = "APIServer pid=7",
) -> str:  # fmt: skip
    return (
        f"({proc}) INFO 12-02 {stamp} [loggers.py:199] Engine {engine:03d}: Iteration({it}): "
        f"{1 if ctx else 0} context requests, {ctx} context tokens, {gen} generation requests, "
        f"{gen} generation tokens, iteration elapsed time: {ms:.2f} ms"
        f"{' (dummy)' if dummy else ''}, {device} KV cache usage: 12.5%"
    )


def read(lines: list[str], **kw: object) -> tuple[list[dict], Counter]:
    status: Counter = Counter()
    reader = VllmLogReader({}, status, lambda: 0.0, **kw)
    steps = [s.fields() for line in lines for s in reader.feed(line)]
    return steps + [s.fields() for s in reader.flush()], status


def test_data_parallel_engines_are_separate_engines() -> None:
    lines = [
        vllm_line(0, 10, "10:00:00", ctx=100),
        vllm_line(1, 10, "10:00:00", ctx=50),  # the same iteration number, another engine
        vllm_line(0, 11, "10:00:00"),
        vllm_line(1, 11, "10:00:00", gen=0, ms=1.0, dummy=True),  # rank 1 idle: not a step
        vllm_line(1, 12, "10:00:01", device="XPU"),
        vllm_line(0, 12, "10:00:02"),
    ]
    steps, status = read(lines)
    by_rank = {r: [(s["iteration"], s["prompt_tokens"]) for s in steps if s["dp_rank"] == r]
               for r in (0, 1)}  # fmt: skip
    assert by_rank == {0: [(10, 100), (11, 0), (12, 0)], 1: [(10, 50), (12, 0)]}
    assert status["idle_iterations"] == 1
    rank1 = [s for s in steps if s["dp_rank"] == 1]
    assert rank1[0]["kv"] == {"unit": "block", "device": "GPU", "usage": 0.125}
    assert rank1[1]["kv"]["device"] == "XPU"
    # Each engine is placed on its own: rank 1's lone step in second 0 sits mid-second.
    assert rank1[0]["t1"] == pytest.approx(0.4995)
    only, status = read(lines, dp_rank=1)
    assert [s["iteration"] for s in only] == [10, 12] and status["other_dp_rank_lines"] == 3


def test_any_process_tag_and_the_engine_core_format() -> None:
    old = (
        "(EngineCore_DP1 pid=2010410) INFO 12-02 21:44:40 [core.py:349] Iteration(515): 0 "
        "context requests, 0 context tokens, 20 generation requests, 20 generation tokens, "
        "iteration elapsed time: 10.99 ms"
    )
    ray = vllm_line(2, 3, "21:44:41", proc="RayWorkerWrapper pid=88, ip=10.0.0.2")
    blocks = old.replace("10.99 ms", "10.25 ms, kv cache: 5.1% (3500/68959 blocks, 56000 tokens)")
    steps, status = read([old, ray, blocks.replace("Iteration(515)", "Iteration(516)")])
    assert [(s["dp_rank"], s["iteration"]) for s in steps] == [(1, 515), (1, 516), (2, 3)]
    assert steps[1]["kv"] == {"unit": "block", "usage": 0.051, "used": 3500, "total": 68959,
                              "tokens": 56000}  # fmt: skip
    assert status["unread_fields"] == 0


def test_millisecond_stamps_are_used_as_they_are() -> None:
    lines = [
        vllm_line(0, 1, "10:00:00.120", ms=30.0),
        vllm_line(0, 2, "10:00:00.120", ms=5.0),  # the log says these two ended together
        vllm_line(0, 3, "10:00:00.480", ms=40.0),
    ]
    steps, _ = read(lines)
    assert [s["t_source"] for s in steps] == ["log"] * 3
    assert [s["t1"] for s in steps] == pytest.approx([0.0, 0.0, 0.36])
    assert steps[2]["t0"] == pytest.approx(0.32)


def test_steps_of_one_second_are_spread_inside_it_never_stacked() -> None:
    lines = [vllm_line(0, i, "10:00:05", ms=100.0) for i in range(5)]
    lines.append(vllm_line(0, 5, "10:00:06", ms=100.0))
    steps, _ = read(lines)
    first = steps[:5]
    ends = [s["t1"] for s in first]
    assert ends == sorted(ends) and len(set(ends)) == 5 and 0 < ends[0] and ends[-1] < 1
    for a, b in zip(first, first[1:], strict=False):
        assert b["t0"] >= a["t1"]  # in order, never overlapping
    assert [round(s["t1"] - s["t0"], 6) for s in first] == [0.1] * 5
    assert {s["t_source"] for s in steps} == {"estimated"}
    assert 1 < steps[5]["t1"] < 2


def test_a_second_busier_than_a_second_is_scaled_to_fit() -> None:
    held = [(_step(0.0), 0.6), (_step(0.0), 0.6), (_step(0.0), 0.6)]
    placed = spread(10.0, held, after=9.2)
    ends = [p.t1 for p in placed]
    assert ends[0] == pytest.approx(10.0) and ends[-1] < 11.0 and ends == sorted(ends)
    assert placed[0].t0 == pytest.approx(9.4)  # its full 0.6 s: it began in the second before
    assert placed[1].t0 == pytest.approx(placed[0].t1)  # clipped: never before the last ended


def test_a_late_line_goes_after_the_last_placed_step() -> None:
    placer = StepPlacer()
    out = placer.add(0, _step(3.0), coarse=True, duration=0.01)
    out += placer.advance(4.0)  # second 3 is over: placed
    late = placer.add(0, _step(3.0), coarse=True, duration=0.01)  # another line of second 3
    assert out[0].t1 == pytest.approx(3.4995) and late[0].t1 == pytest.approx(3.5095)
    assert late[0].t_source == "estimated"


def test_the_engine_clock_meets_the_log_clock() -> None:
    clock = LogClock()
    clock.seconds(*parse_month_day("12-02", "10:00:00"))
    clock.seconds(*parse_month_day("12-02", "10:00:07"))
    ts = 1796205607.25  # 2026-12-02 10:00:07.25 UTC
    assert clock.at_epoch(ts, "UTC") == pytest.approx(7.25)
    assert clock.at_epoch(ts, "Europe/Paris") == pytest.approx(7.25 + 3600)  # a wrong zone shows
    no_date = LogClock()
    no_date.seconds(*parse_stamp(None, "23:59:59"))
    no_date.seconds(*parse_stamp(None, "00:00:03"))  # past midnight
    assert no_date.at_epoch(1796169603.0, "UTC") == pytest.approx(4.0)  # 00:00:03 the next day
    assert LogClock().at_epoch(ts) is None  # no log line yet


def _step(t1: float) -> AggregateStep:
    return AggregateStep(source="vllm-log", phase="decode", t0=t1, t1=t1, t_source="log")
