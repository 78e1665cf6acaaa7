"""EngineMetrics: the Prometheus fold of the protocol's messages, fed by hand-made streams."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics.prometheus import ITL_BUCKETS, TTFT_BUCKETS, EngineMetrics

VLLM_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
    "generation_tokens_total", "num_preemptions_total", "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "iteration_tokens_total_bucket",
]  # fmt: skip


def samples(m: EngineMetrics) -> dict[str, float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            assert s.labels["model_name"] == "m"
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


_STEP_NUMBERS = itertools.count()  # consecutive, as the engine numbers its steps


def step(t0: float, t1: float, items: list[tuple[int, str, int, int]], used: int = 10) -> Any:
    return {
        "type": "step", "step": next(_STEP_NUMBERS), "t0": t0, "t1": t1,
        "items": [{"uid": u, "kind": k, "start": a, "end": b} for u, k, a, b in items],
        "kv": {"total": 100, "used": used, "cached": 0, "free": 100 - used, "reserved": 0},
        "queue": {"waiting": 0, "running": 1},
    }  # fmt: skip


def req(uid: int, event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"type": "request", "uid": uid, "event": event, "t": t, **fields}


def tok(uid: int, t: float) -> dict[str, Any]:
    return {"type": "token", "uid": uid, "t": t, "token_id": 5, "text": "x"}


def feed(m: EngineMetrics, msgs: list[dict[str, Any]]) -> None:
    for msg in msgs:
        m(msg, "")


def test_vllm_names_with_the_stepscope_prefix_are_all_there() -> None:
    s = samples(EngineMetrics("m"))
    for name in VLLM_NAMES:
        assert any(k.startswith("stepscope:" + name) for k in s), name
    assert s["stepscope:num_preemptions_total{}"] == 0
    assert any(k.startswith("stepscope:decode_stall_seconds_bucket") for k in s)
    assert s["stepscope:request_success_total{finished_reason=abort}"] == 0


def test_buckets_include_every_vllm_bound() -> None:
    assert {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 80.0} <= set(
        ITL_BUCKETS
    )
    assert {0.001, 0.005, 0.02, 0.04, 0.06, 0.08, 0.25, 2560.0} <= set(TTFT_BUCKETS)


def test_one_request_lifecycle() -> None:
    m = EngineMetrics("m")
    feed(m, [req(0, "queued", 1.0, prompt_len=8, max_tokens=3)])
    assert samples(m)["stepscope:num_requests_waiting{}"] == 1
    feed(m, [
        step(1.5, 2.0, [(0, "chunk", 0, 4)], used=4), req(0, "admitted", 1.5, cached_len=2),
        step(2.0, 2.5, [(0, "prefill", 4, 8)], used=8), tok(0, 2.5), req(0, "first_token", 2.5),
    ])  # fmt: skip
    s = samples(m)
    assert s["stepscope:num_requests_running{}"] == 1 and s["stepscope:num_requests_waiting{}"] == 0
    assert s["stepscope:kv_cache_usage_perc{}"] == pytest.approx(0.08)
    assert s["stepscope:request_queue_time_seconds_sum{}"] == pytest.approx(0.5)
    assert s["stepscope:time_to_first_token_seconds_sum{}"] == pytest.approx(1.5)
    assert s["stepscope:prefix_cache_queries_total{}"] == 8
    assert s["stepscope:prefix_cache_hits_total{}"] == 2
    assert s["stepscope:prompt_tokens_total{}"] == 8
    feed(m, [
        step(2.5, 2.6, [(0, "decode", 8, 9)]), tok(0, 2.6),
        step(2.6, 2.8, [(0, "decode", 9, 10)]), tok(0, 2.8),
        req(0, "finished", 2.8, output_len=3, finish_reason="length"),
    ])  # fmt: skip
    s = samples(m)
    assert s["stepscope:generation_tokens_total{}"] == 3
    assert s["stepscope:inter_token_latency_seconds_count{}"] == 2
    assert s["stepscope:inter_token_latency_seconds_sum{}"] == pytest.approx(0.3)
    assert s["stepscope:request_time_per_output_token_seconds_sum{}"] == pytest.approx(0.15)
    assert s["stepscope:e2e_request_latency_seconds_sum{}"] == pytest.approx(1.8)
    assert s["stepscope:iteration_tokens_total_sum{}"] == 4 + 4 + 1 + 1
    assert s["stepscope:iteration_tokens_total_count{}"] == 4
    assert s["stepscope:step_duration_seconds_count{}"] == 4
    assert s["stepscope:request_success_total{finished_reason=length}"] == 1
    assert s["stepscope:num_requests_running{}"] == 0
    assert s["stepscope:decode_stall_seconds_count{}"] == 0  # every step included it
    assert s["stepscope:decode_stall_max_seconds{}"] == 0


def test_a_gap_with_a_step_that_skipped_the_request_is_a_stall() -> None:
    m = EngineMetrics("m")
    feed(m, [
        req(0, "queued", 0.0, prompt_len=4), req(0, "admitted", 0.0, cached_len=0),
        step(0.0, 0.1, [(0, "prefill", 0, 4)]), tok(0, 0.1),
        req(1, "queued", 0.1, prompt_len=64),
        # prefill_first: request 1's chunks run while request 0 waits for its next token
        step(0.1, 0.5, [(1, "chunk", 0, 32)]), req(1, "admitted", 0.1, cached_len=0),
        step(0.5, 0.9, [(1, "prefill", 32, 64)]), tok(1, 0.9),
        step(0.9, 1.0, [(0, "decode", 4, 5), (1, "decode", 64, 65)]), tok(0, 1.0), tok(1, 1.0),
        step(1.0, 1.1, [(0, "decode", 5, 6), (1, "decode", 65, 66)]), tok(0, 1.1), tok(1, 1.1),
    ])  # fmt: skip
    s = samples(m)
    assert s["stepscope:decode_stall_seconds_count{}"] == 1
    assert s["stepscope:decode_stall_seconds_sum{}"] == pytest.approx(0.9)
    assert s["stepscope:decode_stall_max_seconds{}"] == pytest.approx(0.9)
    assert s["stepscope:inter_token_latency_seconds_count{}"] == 4
    assert s["stepscope:num_requests_running{}"] == 2


def test_aborts_count_as_abort_unless_a_stop_string_ended_them() -> None:
    m = EngineMetrics("m")
    for uid in (0, 1):
        feed(m, [req(uid, "queued", 0.0, prompt_len=2), req(uid, "admitted", 0.0),
                 step(0.0, 0.1, [(uid, "prefill", 0, 2)]), tok(uid, 0.1)])  # fmt: skip
    m.mark_stop(1)
    feed(m, [req(0, "aborted", 0.2, output_len=1), req(1, "aborted", 0.2, output_len=1)])
    feed(m, [req(2, "queued", 0.3, prompt_len=2), req(2, "rejected", 0.3, message="no")])
    s = samples(m)
    assert s["stepscope:request_success_total{finished_reason=abort}"] == 1
    assert s["stepscope:request_success_total{finished_reason=stop}"] == 1
    assert s["stepscope:e2e_request_latency_seconds_count{}"] == 1  # the stop only
    assert s["stepscope:num_requests_running{}"] == 0
    assert s["stepscope:num_requests_waiting{}"] == 0
    m.set_kv(0, 100)
    assert samples(m)["stepscope:kv_cache_usage_perc{}"] == 0


def test_messages_of_unknown_requests_are_counted_but_do_not_fail() -> None:
    m = EngineMetrics("m")  # e.g. a request queued before the metrics existed
    feed(m, [tok(7, 1.0), req(7, "first_token", 1.0), req(7, "finished", 1.2),
             {"type": "config", "t": 1.0, "policy": "mixed"}])  # fmt: skip
    s = samples(m)
    assert s["stepscope:generation_tokens_total{}"] == 1
    assert s["stepscope:time_to_first_token_seconds_count{}"] == 0
