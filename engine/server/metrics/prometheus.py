"""Prometheus metrics folded from the protocol's message stream, named as vLLM names them.

`EngineMetrics` is a publisher sink: it sees every `step`, `token` and `request` message in the
engine's order (on the publisher's thread) and keeps vLLM's metrics under the prefix
`stepscope:` instead of `vllm:`, with the label `model_name`, so vLLM's Grafana panels work once
the prefix is renamed. Histogram buckets are supersets of vLLM's (every vLLM bound is here, plus
finer ones below 10 ms for GPU decode steps), so a query for a vLLM bucket still finds it.

Under `--metrics-compat vllm` the same figures are also served under vLLM's own names, labels and
bucket boundaries (engine/server/metrics/vllm.py), for vLLM's Grafana dashboards unchanged.

Per-request figures are instrumentation.metrics' (docs/protocol.md, "Metrics"): TTFT is first
token minus queued, ITL the gaps between one request's consecutive tokens, TPOT and e2e latency
`request_metrics`', and a decode stall (stepscope's own `decode_stall_seconds`, with its exact
maximum `decode_stall_max_seconds`) is such a gap during which at least one step ran without the
request (`stalled_between`: a token's step is the `step` message its `token` follows).

Who delayed whom is instrumentation.delay's (docs/protocol.md, "Delay"), from the same stream:
`output_token_prompt_delay_seconds` observes, for every output token, the seconds of the wait
before it charged to other requests' prompt work (chunks, prefills, recomputes: the decode
interference SGLang's users ask a metric for), and `request_waiting_seconds_total{reason}` adds
each request's admission wait by waiting reason when it ends.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from engine.server.metrics.vllm import HttpStats

from instrumentation.delay import DelayLedger, TokenWait
from instrumentation.metrics import request_metrics, stalled_between
from instrumentation.protocol import ENDED_STATES, WAIT_REASONS

PREFIX = "stepscope:"
Message = dict[str, Any]

_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
              7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0)  # fmt: skip
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_FINE = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.0125, 0.015, 0.02, 0.03, 0.04, 0.06,
         0.15, 0.2, 0.3, 0.4)  # fmt: skip

TTFT_BUCKETS = tuple(sorted({*_VLLM_TTFT, *_FINE}))
ITL_BUCKETS = tuple(sorted({*_VLLM_ITL, *_FINE}))
REQUEST_BUCKETS = tuple(sorted({*_VLLM_REQUEST, 0.001, 0.01, 0.05, 0.1, 0.2}))
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# a token that waited for no one's prompt lands at 0: the fraction held up is 1 - that bucket
PROMPT_DELAY_BUCKETS = (0.0, *ITL_BUCKETS)
COMPAT = ("vllm",)


@dataclass(slots=True)
class _Live:
    """What the fold keeps of one request until it ends: its times, and its tokens' times and
    step numbers (for instrumentation.metrics)."""

    t_queued: float
    prompt_len: int
    max_tokens: int = 0
    cached_len: int = 0
    state: str = "waiting"  # or "running"
    t_admitted: float | None = None
    token_times: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)


class _Counter:
    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc, self.value = name, doc, 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _Gauge(_Counter):
    def set(self, value: float) -> None:
        self.value = value


class _Hist:
    """A histogram as plain numbers: one `bisect` and two additions per observation."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class EngineMetrics:
    """A sink `(msg, text) -> None` plus the registry `/metrics` renders.

    The sink runs on the publisher's thread once per message, so per token it costs a few
    additions, not prometheus_client's locked metric objects (several microseconds each, held
    under the GIL the engine thread needs); `collect()` builds the metric families at scrape
    time. Only the publisher thread writes; a scrape may read a histogram mid-update, which
    Prometheus tolerates (the next scrape is consistent).
    """

    def __init__(
        self,
        model_name: str,
        compat: str | None = None,
        max_model_len: int = 8192,
        delays: bool = True,
    ) -> None:
        from engine.server.metrics.vllm import one_two_five

        if compat is not None and compat not in COMPAT:
            raise ValueError(f"metrics compat must be one of {COMPAT}, got {compat!r}")
        self._model = self.model_name = model_name
        self.compat = compat
        self.max_model_len = max_model_len
        self._live: dict[int, _Live] = {}
        self._step_no = -1  # the number of the last step message: the step of the tokens after it
        self._running = 0  # of `_live`, those admitted
        self._stopped: set[int] = set()  # uids the API ended on a stop string
        self._lock = threading.Lock()  # `mark_stop` comes from the HTTP thread
        c, g, h = _Counter, _Gauge, _Hist
        self.running = g("num_requests_running", "Requests admitted and not ended.")
        self.waiting = g("num_requests_waiting", "Requests queued, not yet admitted.")
        self.kv_usage = g(
            "kv_cache_usage_perc", "Fraction of KV pages held by requests (1 = 100%)."
        )
        self.prefix_queries = c(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of prefilled requests.")
        self.prompt_cached = c(
            "prompt_tokens_cached", "Prompt tokens of prefilled requests served by the cache."
        )
        self.generation_tokens = c("generation_tokens", "Generated tokens.")
        self.preemptions = c(
            "num_preemptions",
            "Retractions: running requests sent back to the queue (optimistic admission).",
        )
        self.recomputed = c(
            "prompt_tokens_recomputed",
            "Tokens of retracted requests computed again (prompt plus generated tokens).",
        )
        # vLLM's gauge, with this engine's reasons; the last step's figures
        self.waiting_by_reason = {
            r: g(
                "num_requests_waiting_by_reason", "Waiting requests by why the queue's head waits."
            )
            for r in WAIT_REASONS
        }
        # vLLM's finished_reason values, present at 0 as vLLM's are
        self.success = {r: c("request_success", "Ended requests by finish reason.")
                        for r in ("stop", "length", "abort", "error")}  # fmt: skip
        self.ttft = h("time_to_first_token_seconds", "Queued to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Gap between a request's tokens.", ITL_BUCKETS)
        self.tpot = h(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            ITL_BUCKETS,
        )
        self.queue_time = h("request_queue_time_seconds", "Queued to admitted.", REQUEST_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Queued to last token.", REQUEST_BUCKETS)
        self.prefill_time = h(
            "request_prefill_time_seconds", "Admitted to first token.", REQUEST_BUCKETS
        )
        self.decode_time = h(
            "request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS
        )
        self.inference_time = h(
            "request_inference_time_seconds", "Admitted to last token.", REQUEST_BUCKETS
        )
        lengths = one_two_five(max_model_len)  # vLLM's token-count buckets
        self.request_prompt_tokens = h(
            "request_prompt_tokens", "Prompt tokens of each ended request.", lengths
        )
        self.request_generation_tokens = h(
            "request_generation_tokens", "Generated tokens of each ended request.", lengths
        )
        self.request_max_generation_tokens = h(
            "request_max_num_generation_tokens",
            "Most tokens generated by one sequence of each ended request (n = 1: its own).",
            lengths,
        )
        self.request_max_tokens = h(
            "request_params_max_tokens", "The max_tokens of each ended request.", lengths
        )
        self.iteration_tokens = h(
            "iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS
        )
        self.step_seconds = h(
            "step_duration_seconds", "Engine step, schedule to tokens read (t1 - t0).", ITL_BUCKETS
        )
        self.stall = h(
            "decode_stall_seconds",
            "Token gaps during which at least one engine step ran without the request.",
            ITL_BUCKETS,
        )
        self.stall_max = g(
            "decode_stall_max_seconds", "The longest decode stall of any request so far."
        )
        self.prompt_delay = h(
            "output_token_prompt_delay_seconds",
            "Per output token: seconds of the wait before it charged to other requests' prompt "
            "work (chunks, prefills, recomputes; instrumentation.delay).",
            PROMPT_DELAY_BUCKETS,
        )
        waited = ("Seconds requests waited for admission, by the queue head's waiting reason, "
                  "added when each request ends (its delay's queue).")  # fmt: skip
        self.waited = {r: c("request_waiting_seconds", waited) for r in WAIT_REASONS}
        # the one definition of the delay, folded here for the per-token figure
        self.delays = DelayLedger(on_token=self._token_wait) if delays else None
        self.http: HttpStats | None = None  # set by the HTTP API under the vLLM switch
        if compat == "vllm":
            from engine.server.metrics.vllm import check_bounds

            check_bounds(self)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]  # a collector: `collect()`

    def collect(self) -> Iterator[Metric]:
        """The metric families, for the registry (any thread)."""
        lab = [self._model]
        for g in (self.running, self.waiting, self.kv_usage, self.stall_max):
            fam = GaugeMetricFamily(PREFIX + g.name, g.doc, labels=["model_name"])
            fam.add_metric(lab, g.value)
            yield fam
        some_g = next(iter(self.waiting_by_reason.values()))
        fam = GaugeMetricFamily(PREFIX + some_g.name, some_g.doc, labels=["model_name", "reason"])
        for reason, gauge in self.waiting_by_reason.items():
            fam.add_metric([self._model, reason], gauge.value)
        yield fam
        some = next(iter(self.waited.values()))
        fam = CounterMetricFamily(PREFIX + some.name, some.doc, labels=["model_name", "reason"])
        for reason, k in list(self.waited.items()):
            fam.add_metric([self._model, reason], k.value)
        yield fam
        counters = (self.prefix_queries, self.prefix_hits, self.prompt_tokens,
                    self.prompt_cached, self.generation_tokens, self.preemptions,
                    self.recomputed)  # fmt: skip
        for k in counters:
            fam = CounterMetricFamily(PREFIX + k.name, k.doc, labels=["model_name"])
            fam.add_metric(lab, k.value)
            yield fam
        some = next(iter(self.success.values()))
        fam = CounterMetricFamily(
            PREFIX + some.name, some.doc, labels=["model_name", "finished_reason"]
        )
        for reason, k in self.success.items():
            fam.add_metric([self._model, reason], k.value)
        yield fam
        hists = (self.ttft, self.itl, self.tpot, self.queue_time, self.e2e, self.prefill_time,
                 self.decode_time, self.inference_time, self.request_prompt_tokens,
                 self.request_generation_tokens, self.request_max_generation_tokens,
                 self.request_max_tokens, self.iteration_tokens, self.step_seconds,
                 self.stall, self.prompt_delay)  # fmt: skip
        for h in hists:
            counts, total = list(h.counts), h.sum  # a snapshot
            cum, buckets = 0, []
            for bound, n in zip((*h.bounds, math.inf), counts, strict=True):
                cum += n
                buckets.append(("+Inf" if math.isinf(bound) else floatToGoString(bound), cum))
            fam = HistogramMetricFamily(PREFIX + h.name, h.doc, labels=["model_name"])
            fam.add_metric(lab, buckets, sum_value=total)
            yield fam
        if self.compat == "vllm":
            from engine.server.metrics.vllm import vllm_families

            yield from vllm_families(self)
            if self.http is not None:
                yield from self.http.families()

    # -- the sink (publisher thread) -----------------------------------------------------
    def __call__(self, msg: Message, _text: str = "") -> None:
        kind = msg.get("type")
        delay = self.delays.apply(msg) if self.delays is not None else None  # per token
        if delay is not None:  # a request ended
            for reason, seconds in delay.queue.items():
                k = self.waited.get(reason)
                if k is None:  # a reason this engine does not name (a stream before v1.3)
                    some = self.waited["kv"]
                    k = self.waited[reason] = _Counter(some.name, some.doc)
                k.inc(seconds)
        if kind == "token":
            self._token(msg)
        elif kind == "step":
            self._step(msg)
        elif kind == "request":
            self._request(msg)

    def mark_stop(self, uid: int) -> None:
        """The API is aborting `uid` because a stop string matched: it ends as `stop`."""
        with self._lock:
            if uid in self._live:  # not if its end was folded already (nothing would remove it)
                self._stopped.add(uid)

    def set_kv(self, used: int, total: int) -> None:
        """Refresh the KV gauge from a live reading (steps only report it while they run)."""
        self.kv_usage.set(used / total if total else 0.0)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _step(self, msg: Message) -> None:
        self._step_no = int(msg["step"])
        self.iteration_tokens.observe(sum(i["end"] - i["start"] for i in msg["items"]))
        self.step_seconds.observe(msg["t1"] - msg["t0"])
        kv = msg["kv"]
        self.set_kv(kv["used"], kv["total"])
        self.recomputed.inc(
            sum(i["end"] - i["start"] for i in msg["items"] if i["kind"] == "recompute")
        )
        by_reason = (msg.get("queue") or {}).get("waiting_by_reason") or {}
        for reason, gauge in self.waiting_by_reason.items():
            gauge.set(by_reason.get(reason, 0))

    def _token_wait(self, wait: TokenWait) -> None:
        self.prompt_delay.observe(wait.by_prompt)

    def _token(self, msg: Message) -> None:
        self.generation_tokens.inc()
        r = self._live.get(msg["uid"])
        if r is None:
            return
        t = msg["t"]
        if r.token_times:
            gap = t - r.token_times[-1]
            self.itl.observe(gap)
            if stalled_between(r.token_steps[-1], self._step_no):
                self.stall.observe(gap)
                self.stall_max.set(max(self.stall_max.value, gap))
        else:
            self.ttft.observe(t - r.t_queued)
        r.token_times.append(t)
        r.token_steps.append(self._step_no)

    def _request(self, msg: Message) -> None:
        uid, event, t = msg["uid"], msg["event"], msg["t"]
        if event == "queued":
            self._live[uid] = _Live(t, int(msg.get("prompt_len", 0)), int(msg.get("max_tokens", 0)))
            self._gauges()
            return
        r = self._live.get(uid)
        if r is None:
            return
        if event == "retracted":
            self.preemptions.inc()
            r.state = "waiting"
            self._running -= 1
            self._gauges()
        elif event == "admitted" and msg.get("recompute"):  # readmitted after a retraction
            r.state = "running"
            self._running += 1
            self._gauges()
        elif event == "admitted":
            r.state = "running"
            r.t_admitted = t
            self._running += 1
            self.queue_time.observe(t - r.t_queued)
            self.prefix_queries.inc(r.prompt_len)
            r.cached_len = int(msg.get("cached_len", 0))
            self.prefix_hits.inc(r.cached_len)
            self._gauges()
        elif event == "first_token":
            self.prompt_tokens.inc(r.prompt_len)
            self.prompt_cached.inc(r.cached_len)
        elif event in ENDED_STATES:
            del self._live[uid]
            self._running -= r.state == "running"
            with self._lock:
                stopped = uid in self._stopped
                self._stopped.discard(uid)
            if event == "finished" or stopped:
                reason = "length" if msg.get("finish_reason") == "length" else "stop"
                self._ended(r, reason)
            elif event == "aborted":
                self.success["abort"].inc()
            else:  # rejected: the engine could not run it
                self.success["error"].inc()
            self._gauges()

    def _ended(self, r: _Live, reason: str) -> None:
        self.success[reason].inc()
        m = request_metrics(r.t_queued, r.t_admitted, r.token_times, r.token_steps)
        if m["e2e_request_latency_seconds"] is not None:
            self.e2e.observe(m["e2e_request_latency_seconds"])
        if m["time_per_output_token_seconds"] is not None:
            self.tpot.observe(m["time_per_output_token_seconds"])
        # vLLM's per-request phases and lengths, recorded when a request ends as vLLM does
        for hist, key in ((self.prefill_time, "prefill_time_seconds"),
                          (self.decode_time, "decode_time_seconds"),
                          (self.inference_time, "inference_time_seconds")):  # fmt: skip
            if m[key] is not None:
                hist.observe(m[key])
        output = len(r.token_times)
        self.request_prompt_tokens.observe(r.prompt_len)
        self.request_generation_tokens.observe(output)
        self.request_max_generation_tokens.observe(output)
        if r.max_tokens:
            self.request_max_tokens.observe(r.max_tokens)

    def _gauges(self) -> None:
        self.running.set(self._running)
        self.waiting.set(len(self._live) - self._running)
