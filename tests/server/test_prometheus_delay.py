"""/metrics' figures of the delay (instrumentation.delay): per output token, the wait charged
to other requests' prompt work; the admission wait by reason; and vLLM's cache tiers under
`--metrics-compat vllm`."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics.prometheus import EngineMetrics
from instrumentation.delay import delays_of
from tests.server.test_prometheus import feed, req, samples, tok


def step(n: int, t0: float, t1: float, items: list[tuple], reason: str | None = None) -> Any:
    return {
        "type": "step", "step": n, "t0": t0, "t1": t1,
        "items": [{"uid": u, "kind": k, "start": a, "end": b} for u, k, a, b in items],
        "kv": {"total": 100, "used": 10, "cached": 0, "free": 90, "reserved": 0},
        "queue": {"waiting": int(reason is not None), "running": 1, "waiting_reason": reason,
                  "waiting_by_reason": {reason: 1} if reason else {}},
    }  # fmt: skip


def chat_and_long_prompt() -> list[dict[str, Any]]:
    """Request 0 decodes; request 1 waits a step behind the budget, then its 200-token prompt
    runs in two 50 ms chunks under prefill_first while request 0 waits."""
    return [
        req(0, "queued", 0.0, prompt_len=4, max_tokens=3), req(1, "queued", 0.0, prompt_len=200),
        step(0, 0.0, 0.010, [(0, "prefill", 0, 4)], reason="budget"), tok(0, 0.010),
        step(1, 0.010, 0.060, [(1, "chunk", 0, 100)]),
        step(2, 0.060, 0.110, [(1, "prefill", 100, 200)]), tok(1, 0.110),
        req(1, "finished", 0.110, finish_reason="length"),
        step(3, 0.110, 0.120, [(0, "decode", 4, 5)]), tok(0, 0.120),
        step(4, 0.120, 0.130, [(0, "decode", 5, 6)]), tok(0, 0.130),
        req(0, "finished", 0.130, finish_reason="length"),
    ]  # fmt: skip


def test_each_output_token_observes_the_prompt_work_it_waited_for() -> None:
    m = EngineMetrics("m")
    feed(m, chat_and_long_prompt())
    s = samples(m)
    name = "stepscope:output_token_prompt_delay_seconds"
    assert s[f"{name}_count{{}}"] == 4  # every output token: three of request 0, one of 1
    assert s[f"{name}_bucket{{le=0.0}}"] == 3  # only request 0's second token waited
    assert abs(s[f"{name}_sum{{}}"] - 0.1) < 1e-9  # for request 1's two chunks
    assert s[f"{name}_bucket{{le=0.1}}"] == 4


def test_no_delays_leaves_the_delay_series_empty_and_the_rest_counted() -> None:
    m = EngineMetrics("m", delays=False)  # the server's --no-delays
    feed(m, chat_and_long_prompt())
    s = samples(m)
    assert s["stepscope:output_token_prompt_delay_seconds_count{}"] == 0
    assert s["stepscope:request_waiting_seconds_total{reason=budget}"] == 0
    assert s["stepscope:generation_tokens_total{}"] == 4


def test_the_admission_wait_is_counted_by_reason_as_each_request_ends() -> None:
    m = EngineMetrics("m")
    msgs = chat_and_long_prompt()
    feed(m, msgs[:6])  # request 1 has waited, and not ended yet
    assert samples(m)["stepscope:request_waiting_seconds_total{reason=budget}"] == 0
    feed(m, msgs[6:])
    s = samples(m)
    assert s["stepscope:request_waiting_seconds_total{reason=budget}"] == 0.010
    assert s["stepscope:request_waiting_seconds_total{reason=kv}"] == 0
    # the same figure as the end events' delay (one definition)
    assert delays_of(msgs)[1].queue == {"budget": 0.010}


def test_vllm_names_the_cached_prompt_tokens_by_tier() -> None:
    m = EngineMetrics("m", compat="vllm", max_model_len=2048)
    feed(m, [
        req(0, "queued", 0.0, prompt_len=8, max_tokens=1),
        step(0, 0.0, 0.1, [(0, "prefill", 6, 8)]), req(0, "admitted", 0.0, cached_len=6),
        tok(0, 0.1), req(0, "first_token", 0.1), req(0, "finished", 0.1, finish_reason="length"),
    ])  # fmt: skip
    body, _ = m.render()
    got = {(s.name, s.labels.get("source")): s.value
           for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}  # fmt: skip
    assert got["vllm:prompt_tokens_cached_by_source_total", "device"] == 6
    for tier in ("host", "p2p", "disk", "external_unspecified"):
        assert got["vllm:prompt_tokens_cached_by_source_total", tier] == 0
    assert got["vllm:prompt_tokens_cached_total", None] == 6  # the tiers add up to it
