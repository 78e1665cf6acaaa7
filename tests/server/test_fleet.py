"""Replicas behind SGLang's Model Gateway: the worker API the gateway calls (SGLang's
`/server_info`, `/model_info`, `/get_load`, `/health_generate`, `/flush_cache`, `/generate`), and
the one-command fleet (`engine.server.fleet`) with the real `sglang-router` in front, on the tiny
random Llama: requests with shared prefixes reach both replicas, and every greedy completion
equals the same prompt sent to one replica alone. The fleet records itself (`--trace-dir`): a
trace per replica, which app/fleet_replay.py loads on one clock, every request in it.
"""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.fleet_replay import FleetRecording
from engine.server.fleet import Fleet, FleetInfo, build_parser, free_port
from engine.server.openai.schema import ApiError
from engine.server.sglang.worker import to_completion_body

# One xdist worker runs this module, so its module-scoped fleet is set up once (tests spread
# over both workers had each worker set up its own).
pytestmark = pytest.mark.xdist_group("test_fleet")

HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None


def call(url: str, body: Any = None, method: str | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def complete(base: str, prompt: str, max_tokens: int = 8) -> str:
    model = json.loads(call(base + "/v1/models")[1])["data"][0]["id"]
    status, body = call(
        base + "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True},
    )  # fmt: skip
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def served(http: str) -> int:
    _, text = call(http + "/metrics")
    total = 0.0
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name == "stepscope:request_success":
            total += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return int(total)


# -- the /generate translation, on its own ------------------------------------------------------
def test_generate_body_maps_to_a_completion_and_refuses_what_it_cannot_honour() -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop": ["."]},
            "stream": True, "model": None, "log_metrics": True, "return_logprob": False}  # fmt: skip
    assert to_completion_body(body) == {
        "prompt": "hi", "stream": True, "max_tokens": 4, "temperature": 0, "stop": ["."],
    }  # fmt: skip
    assert to_completion_body({"input_ids": [1, 2]})["max_tokens"] == 128  # SGLang's default
    for bad in (
        {"text": "a", "input_ids": [1]},
        {},
        {"text": ["a", "b"]},
        {"text": "a", "sampling_params": {"frequency_penalty": 0.5}},
        {"text": "a", "return_logprob": True},
        {"text": "a", "lora_path": "x"},
        {"text": "a", "sampling_params": []},
        [1, 2],
    ):
        with pytest.raises(ApiError) as exc:
            to_completion_body(bad)
        assert exc.value.status == 400


def test_a_fleet_refuses_settings_it_owns() -> None:
    with pytest.raises(ValueError, match="--port"):
        Fleet(2, ["--port", "9000"])
    with pytest.raises(ValueError, match="unknown router policy"):
        Fleet(2, [], router_policy="fastest")
    with pytest.raises(ValueError, match="at least 2"):
        Fleet(1, [], router_policy="power_of_two")
    with pytest.raises(ValueError, match="at least 1"):
        Fleet(0, [])
    assert build_parser().parse_args(["--trace-dir", "D"]).trace_dir == Path("D")
    for one_file in (["--trace", "t.jsonl"], ["--trace=t.jsonl"]):
        with pytest.raises(ValueError, match="--trace-dir"):
            Fleet(2, one_file)


# -- a live fleet ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetInfo]:
    policy = "cache_aware" if HAS_ROUTER else None
    f = Fleet(
        2, ["--model", str(tiny_llama_dir), "--threads", "1", "--max-running-req", "8"],
        router_policy=policy, gateway_port=free_port(),
        trace_dir=tmp_path_factory.mktemp("fleet") / "traces",
    )  # fmt: skip
    try:
        info = f.start()
        yield info
    finally:
        f.stop()


def test_each_replica_serves_the_gateways_worker_api(fleet: FleetInfo) -> None:
    http = fleet.replicas[0].http
    status, body = call(http + "/server_info")
    info = json.loads(body)
    assert status == 200 and info["dp_size"] == 1 and info["chunked_prefill_size"] > 0
    assert Path(info["model_path"]).is_dir()  # a local directory: the gateway's tokenizer
    status, body = call(http + "/get_server_info")  # the older name, which the gateway tries next
    assert status == 200 and json.loads(body)["model_path"] == info["model_path"]
    status, body = call(http + "/get_model_info")
    assert status == 200 and json.loads(body)["is_generation"] is True
    status, body = call(http + "/get_load")
    (load,) = json.loads(body)
    assert status == 200 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load)
    assert call(http + "/health_generate")[0] == 200

    # /generate is /v1/completions in SGLang's shape, streamed or not
    want = complete(http, "river stone light", 6)
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, body = call(http + "/generate", {"text": "river stone light", "sampling_params": sp})
    out = json.loads(body)
    assert status == 200 and out["text"] == want
    assert out["meta_info"]["completion_tokens"] == 6
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    status, body = call(
        http + "/generate", {"text": "river stone light", "sampling_params": sp, "stream": True}
    )
    chunks = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert status == 200 and chunks[-1]["text"] == want
    assert all(want.startswith(c["text"]) for c in chunks)  # cumulative, as SGLang streams
    status, body = call(http + "/generate", {"text": "x", "sampling_params": {"n": 0}})
    assert status == 400

    # the cache is flushed only when idle, and then holds nothing
    status, body = call(http + "/flush_cache", {})
    assert status == 200, body
    assert json.loads(call(http + "/get_load")[1])[0]["num_tokens"] == 0


@pytest.mark.skipif(not HAS_ROUTER, reason="sglang-router is not installed (the fleet extra)")
def test_the_gateway_spreads_shared_prefix_chats_over_both_replicas_with_single_engine_output(
    fleet: FleetInfo,
) -> None:
    assert fleet.gateway is not None
    systems = [f"system prompt {k}: " + "quiet north glass bread " * 6 for k in range(4)]
    prompts = [systems[i % 4] + f"question {i} about seven rivers" for i in range(24)]
    before = [served(r.http) for r in fleet.replicas]
    with ThreadPoolExecutor(8) as pool:
        routed = list(pool.map(lambda p: complete(fleet.gateway, p), prompts))
    after = [served(r.http) for r in fleet.replicas]
    per_replica = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(per_replica) == len(prompts)
    assert all(n > 0 for n in per_replica), per_replica  # both replicas took requests
    alone = [complete(fleet.replicas[0].http, p) for p in prompts]
    assert routed == alone


def test_the_fleet_records_a_trace_per_replica_on_one_clock(fleet: FleetInfo) -> None:
    """Last in this module: the traces hold what the tests above sent."""
    assert fleet.trace_dir is not None
    traces = [r.trace for r in fleet.replicas]
    assert traces == [str(Path(fleet.trace_dir) / f"replica-{i}.jsonl") for i in (0, 1)]
    deadline = time.monotonic() + 30  # a request's last message reaches the trace as it ends
    while True:
        served_now = [served(r.http) for r in fleet.replicas]
        recording = FleetRecording.load(fleet.trace_dir)
        finished = [s.finished for s in recording.summaries]
        if finished == served_now or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert finished == served_now and sum(finished) > 0
    assert recording.numbers == (0, 1) and recording.aligned  # hello.engine.clock_epoch
    # the replicas started together: one is the fleet clock's origin, the other within a minute
    assert min(recording.offsets) == 0.0 and max(recording.offsets) < 60
    assert recording.total.requests == sum(s.requests for s in recording.summaries)
