"""vLLM's own Grafana dashboards against stepscope's /metrics under `--metrics-compat vllm`.

tests/fixtures/vllm-dashboards/ holds the PromQL of two of vLLM's dashboards (queries.json, with
their source commits) and the /metrics of a real vLLM 0.32.0 (the CPU wheel, serving SmolLM2 on
this machine, before any request). Every metric the dashboards query that the real vLLM exports
must be served by stepscope under the switch, labelled with `model_name` (and vLLM's `engine`),
with every label value the queries select on (finished_reason="error", reason="capacity", ...)
and every SLO threshold the dashboards offer as a bucket bound.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics.prometheus import EngineMetrics
from engine.server.metrics.vllm import HttpStats
from tests.server.test_prometheus import feed, req, step, tok

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm-dashboards"
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
BARE = re.compile(r"label_values\(([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,")
MATCHER = re.compile(r'([a-zA-Z_]+)\s*(=~|!=|!~|=)\s*"([^"]*)"')
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
MODEL = "SmolLM2-135M-Instruct"


def queried() -> dict[str, list[dict[str, str]]]:
    """Each metric (sample name) the dashboards query, with its selectors' equality matchers."""
    out: dict[str, list[dict[str, str]]] = {}
    for board in json.loads((FIXTURES / "queries.json").read_text())["dashboards"].values():
        for expr in board["targets"] + board["variables"]:
            for name, body in SELECTOR.findall(expr):
                eq = {k: v for k, op, v in MATCHER.findall(body) if op == "="}
                out.setdefault(name, []).append(eq)
            for name in BARE.findall(expr):
                out.setdefault(name, []).append({})
    return out


def exported(text: str) -> set[str]:
    """The sample names a /metrics text can hold, from its families' types (a family with no
    samples yet, like vLLM's http_requests_total before any request, counts)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
        names |= {s.name for s in fam.samples}
    return names


def served() -> list[Any]:
    """Stepscope's samples under the switch, after one request and one HTTP request."""
    m = EngineMetrics(MODEL, compat="vllm", max_model_len=2048)
    m.http = HttpStats(frozenset(("/v1/completions",)))
    feed(m, [
        req(0, "queued", 1.0, prompt_len=8, max_tokens=2),
        step(1.5, 2.0, [(0, "prefill", 0, 8)]), req(0, "admitted", 1.5, cached_len=0),
        tok(0, 2.0), req(0, "first_token", 2.0),
        step(2.0, 2.1, [(0, "decode", 8, 9)]), tok(0, 2.1),
        req(0, "finished", 2.1, output_len=2, finish_reason="length", prefill_time_seconds=0.5,
            decode_time_seconds=0.1, inference_time_seconds=0.6),
    ])  # fmt: skip
    m.http.observe("/v1/completions", "POST", 200, 0.7)
    m.http.observe("/v1/completions", "POST", 500, 0.01)  # a series per status class seen
    body, _ = m.render()
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def test_every_metric_the_dashboards_query_that_vllm_exports_is_served() -> None:
    real = exported((FIXTURES / "vllm-0.32.0-cpu-smollm2.prom").read_text())
    wanted = {name: sels for name, sels in queried().items() if name in real}
    # the dashboards query what vLLM exports, bar Prometheus' own `up`
    assert set(queried()) - real == {"up"}
    assert len(wanted) >= 30
    samples = served()
    names = {s.name for s in samples}
    assert not set(wanted) - names, sorted(set(wanted) - names)
    for name, selectors in wanted.items():
        ours = [s.labels for s in samples if s.name == name]
        if name.startswith("vllm:"):  # the dashboards filter on model_name
            assert all(lab["model_name"] == MODEL and lab["engine"] == "0" for lab in ours), name
        for eq in selectors:
            want = {k: v for k, v in eq.items() if k not in ("model_name", "le")}
            assert any(want.items() <= lab.items() for lab in ours), (name, want)


def test_the_slo_thresholds_are_bucket_bounds() -> None:
    boards = json.loads((FIXTURES / "queries.json").read_text())["dashboards"]
    slo = boards["dashboards/grafana/vllm_overview.json"]["slo_buckets"]
    samples = served()
    for var, metric in (("ttft_slo", "vllm:time_to_first_token_seconds_bucket"),
                        ("tpot_slo", "vllm:request_time_per_output_token_seconds_bucket")):  # fmt: skip
        bounds = {s.labels["le"] for s in samples if s.name == metric}
        assert set(slo[var]) <= bounds, (var, set(slo[var]) - bounds)


def test_buckets_are_vllms_and_agree_with_stepscopes() -> None:
    real = {}
    for fam in text_string_to_metric_families(
        (FIXTURES / "vllm-0.32.0-cpu-smollm2.prom").read_text()
    ):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                real.setdefault(s.name, []).append(s.labels["le"])
    samples = served()
    ours: dict[str, list[str]] = {}
    for s in samples:
        if s.name.startswith("vllm:") and s.name.endswith("_bucket"):
            ours.setdefault(s.name, []).append(s.labels["le"])
    for name, bounds in ours.items():
        assert bounds == real[name], name  # the same boundaries, in order
    value = {(s.name, s.labels.get("le")): s.value for s in samples}
    # one figure, two names: the vLLM bucket is stepscope's cumulative count at that bound
    assert (
        value[("vllm:iteration_tokens_total_bucket", "1.0")]
        == value[("stepscope:iteration_tokens_total_bucket", "1.0")]
        == 1
    )  # the decode step
    assert value[("vllm:iteration_tokens_total_bucket", "8.0")] == 2  # and the prefill
    assert value[("vllm:request_prefill_time_seconds_sum", None)] == 0.5
    assert value[("vllm:request_prompt_tokens_bucket", "10.0")] == 1
    assert value[("vllm:request_prompt_tokens_bucket", "5.0")] == 0
