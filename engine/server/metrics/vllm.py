"""vLLM's metric names, labels and buckets over stepscope's fold (`--metrics-compat vllm`).

With the switch, /metrics also serves every metric vLLM's Grafana dashboards query under the
names a real vLLM exports (`vllm:` prefix, labels `model_name` and `engine`, vLLM's bucket
boundaries), so those dashboards work unchanged. Nothing is measured twice: each family is a
view of one of `EngineMetrics`' figures, and a histogram's vLLM buckets are read from its own
cumulative counts (every vLLM bound is one of stepscope's, checked at import), so the two names
of one figure always agree.

Bounds are vLLM 0.32's (vllm/v1/metrics/buckets.py): request latencies, TTFT, ITL, iteration
tokens (1, 8, 16, ... 16384), and 1-2-5 token counts up to max_model_len.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

# engine/server/metrics/prometheus.py's EngineMetrics and its histograms; not imported, since that
# module imports this one (the layers stay acyclic)
EngineMetrics = Any
_Hist = Any

PREFIX = "vllm:"
LABELS = ["model_name", "engine"]
ENGINE = "0"  # one engine core, as vLLM's index 0

REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
WAITING_REASONS = ("capacity", "deferred")
CACHE_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # vLLM's tiers


def one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's token-count buckets."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def _project(h: _Hist, bounds: tuple[float, ...]) -> list[tuple[str, float]]:
    """The cumulative counts of `h` at `bounds` (each one of h's own bounds) and +Inf."""
    cum, at = 0, {}
    for bound, n in zip((*h.bounds, math.inf), list(h.counts), strict=True):
        cum += n
        at[bound] = cum
    out = [(floatToGoString(b), at[b]) for b in bounds]
    return [*out, ("+Inf", cum)]


def check_bounds(m: EngineMetrics) -> None:
    """Every vLLM bound must be a bound of the stepscope histogram it is read from."""
    for h, bounds in _histograms(m):
        missing = set(bounds) - set(h.bounds)
        assert not missing, f"{h.name}: vLLM bounds {sorted(missing)} are not stepscope's"


def _histograms(m: EngineMetrics) -> list[tuple[_Hist, tuple[float, ...]]]:
    tokens = one_two_five(m.max_model_len)
    return [
        (m.ttft, TTFT),
        (m.itl, ITL),
        (m.tpot, ITL),
        (m.e2e, REQUEST_LATENCY),
        (m.queue_time, REQUEST_LATENCY),
        (m.prefill_time, REQUEST_LATENCY),
        (m.decode_time, REQUEST_LATENCY),
        (m.inference_time, REQUEST_LATENCY),
        (m.iteration_tokens, ITERATION_TOKENS),
        (m.request_prompt_tokens, tokens),
        (m.request_generation_tokens, tokens),
        (m.request_max_generation_tokens, tokens),
        (m.request_max_tokens, tokens),
    ]


def vllm_families(m: EngineMetrics) -> Iterator[Metric]:
    """The vLLM-named families of `m`'s figures."""
    lab = [m.model_name, ENGINE]
    for g in (m.running, m.waiting, m.kv_usage):
        fam = GaugeMetricFamily(PREFIX + g.name, g.doc, labels=LABELS)
        fam.add_metric(lab, g.value)
        yield fam
    fam = GaugeMetricFamily(
        PREFIX + "num_requests_waiting_by_reason",
        "Waiting requests by reason: all wait for capacity (rows, KV pages, the token budget).",
        labels=[*LABELS, "reason"],
    )
    for reason in WAITING_REASONS:
        fam.add_metric([*lab, reason], m.waiting.value if reason == "capacity" else 0)
    yield fam
    for k in (m.prefix_queries, m.prefix_hits, m.prompt_tokens, m.generation_tokens,
              m.preemptions):  # fmt: skip
        fam = CounterMetricFamily(PREFIX + k.name, k.doc, labels=LABELS)
        fam.add_metric(lab, k.value)
        yield fam
    some = next(iter(m.success.values()))
    fam = CounterMetricFamily(PREFIX + some.name, some.doc, labels=[*LABELS, "finished_reason"])
    for reason in FINISH_REASONS:
        k = m.success.get(reason)
        fam.add_metric([*lab, reason], 0 if k is None else k.value)
    yield fam
    fam = CounterMetricFamily(
        PREFIX + "prompt_tokens_by_source",
        "Prompt tokens by source: computed, or served by the prefix cache.",
        labels=[*LABELS, "source"],
    )
    computed = m.prompt_tokens.value - m.prompt_cached.value
    for source, value in (("local_compute", computed), ("local_cache_hit", m.prompt_cached.value),
                          ("external_kv_transfer", 0)):  # fmt: skip
        fam.add_metric([*lab, source], value)
    yield fam
    fam = CounterMetricFamily(
        PREFIX + "prompt_tokens_cached", "Prompt tokens served by the prefix cache.", labels=LABELS
    )
    fam.add_metric(lab, m.prompt_cached.value)
    yield fam
    # vLLM's cache tiers: this engine's prefix cache lives with the model (`device`), it has no
    # host, peer or disk tier; the sources add up to prompt_tokens_cached, as vLLM's do
    fam = CounterMetricFamily(
        PREFIX + "prompt_tokens_cached_by_source",
        "Prompt tokens served by a cache, by the tier that held them.",
        labels=[*LABELS, "source"],
    )
    for source in CACHE_SOURCES:
        fam.add_metric([*lab, source], m.prompt_cached.value if source == "device" else 0)
    yield fam
    # caches this engine does not have: there at 0, as a real vLLM without them exports them
    for name, doc in (("external_prefix_cache", "a KV connector's cross-instance cache"),
                      ("mm_cache", "the multimodal input cache")):  # fmt: skip
        for kind in ("queries", "hits"):
            fam = CounterMetricFamily(f"{PREFIX}{name}_{kind}", f"{kind} of {doc} (none here)",
                                      labels=LABELS)  # fmt: skip
            fam.add_metric(lab, 0)
            yield fam
    for h, bounds in _histograms(m):
        fam = HistogramMetricFamily(PREFIX + h.name, h.doc, labels=LABELS)
        fam.add_metric(lab, _project(h, bounds), sum_value=h.sum)
        yield fam


HTTP_DURATION_BUCKETS = (0.1, 0.5, 1.0)  # prometheus-fastapi-instrumentator's defaults
HTTP_EXCLUDED = frozenset(("/metrics", "/health"))  # as vLLM excludes its probes


class HttpStats:
    """HTTP requests as vLLM's API server counts them (prometheus-fastapi-instrumentator):
    `http_requests_total{handler, method, status}` with the status as its class ("2xx") and
    `http_request_duration_seconds{handler, method}`, to the end of the response (a stream's
    last event). Probes are left out; a path that is no route is the handler "none"."""

    def __init__(self, routes: frozenset[str]) -> None:
        self.routes = routes
        self.requests: dict[tuple[str, str, str], int] = {}
        self.durations: dict[tuple[str, str], list[float]] = {}  # counts per bound, +Inf; sum

    def observe(self, path: str, method: str, status: int, seconds: float) -> None:
        """The HTTP loop's thread only."""
        if path in HTTP_EXCLUDED:
            return
        handler = path if path in self.routes else "none"
        key = (handler, method, f"{status // 100}xx")
        self.requests[key] = self.requests.get(key, 0) + 1
        row = self.durations.setdefault((handler, method), [0.0] * (len(HTTP_DURATION_BUCKETS) + 2))
        row[sum(seconds > b for b in HTTP_DURATION_BUCKETS)] += 1
        row[-1] += seconds

    def families(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "http_requests_total", "Total number of requests by method, status and handler.",
            labels=["handler", "method", "status"],
        )  # fmt: skip
        for labels, n in list(self.requests.items()):
            fam.add_metric(list(labels), n)
        yield fam
        fam = HistogramMetricFamily(
            "http_request_duration_seconds", "Duration of HTTP requests in seconds.",
            labels=["handler", "method"],
        )  # fmt: skip
        for labels, row in list(self.durations.items()):
            cum, buckets = 0.0, []
            for bound, n in zip((*HTTP_DURATION_BUCKETS, math.inf), row[:-1], strict=True):
                cum += n
                buckets.append(("+Inf" if math.isinf(bound) else floatToGoString(bound), cum))
            fam.add_metric(list(labels), buckets, sum_value=row[-1])
        yield fam
