"""One definition of each request figure.

- A recorded server run: three chats are decoding when a long prompt arrives, with a small
  budget. Under `prefill_first` the chats stall while the prompt is chunked; under `mixed` they
  never do. Every `finished` event's `max_stall_seconds` equals the stall recomputed here from
  the trace's `step` and `token` messages by docs/protocol.md's words (not by calling the
  project's function), and `/metrics` states the same worst stall and stall count.
- One run's trace gives the same TTFT p50, ITL p99 and worst stall through the page's headline,
  replay compare, the sweep summary, the `/metrics` exporter and `generate()`'s metrics.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_openai_api import ApiServer, scrape, stop
from tests.server.test_server_lifecycle import port_is_free
from tests.server.test_server_support import Msg, ProtoClient

# One xdist worker runs this module, so its module-scoped server is set up once (tests spread
# over both workers had each worker set up its own).
pytestmark = pytest.mark.xdist_group("test_one_truth")

BUDGET = 8
CHATS = 3
CHAT_PROMPT = 4
CHAT_TOKENS = 100  # still decoding, with a wide margin, while the long prompt is chunked
LONG_PROMPT = 96  # 12 chunks of the budget under prefill_first


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


# ---- the protocol's definition, recomputed from a trace by hand ------------------------------


def stalls_by_hand(msgs: list[Msg]) -> dict[int, list[float]]:
    """docs/protocol.md: a stall is a gap between two of a request's tokens during which at least
    one step ran without it. A request's tokens come from the steps whose items sample one for it
    (`prefill` or `decode`, not wasted), at the step's `t1`; the steps that ran are the step
    messages, numbered consecutively."""
    numbers = [m["step"] for m in msgs if m["type"] == "step"]
    # every step that ran while the trace was written is in it
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    sampled: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for m in msgs:
        if m["type"] != "step":
            continue
        for item in m["items"]:
            if item["kind"] in ("prefill", "decode") and not item.get("wasted"):
                sampled[item["uid"]].append((m["step"], m["t1"]))
    ran = set(numbers)
    out: dict[int, list[float]] = {}
    for uid, toks in sampled.items():
        gaps = []
        for (step_a, t_a), (step_b, t_b) in zip(toks, toks[1:], strict=False):
            if any(n in ran for n in range(step_a + 1, step_b)):
                gaps.append(t_b - t_a)
        out[uid] = gaps
    return out


def token_times(msgs: list[Msg]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = defaultdict(list)
    for m in msgs:
        if m["type"] == "token":
            out[m["uid"]].append(m["t"])
    return out


def finished_events(msgs: list[Msg]) -> dict[int, Msg]:
    return {m["uid"]: m for m in msgs if m["type"] == "request" and m["event"] == "finished"}


# ---- a recorded server run ---------------------------------------------------------------------


def chats_meet_a_long_prompt(c: ProtoClient, policy: str, seed: int) -> dict[str, Any]:
    """Three chats decode; a long prompt arrives; all run to their end. Returns the uids."""
    reply = c.reply({"type": "set_config", "id": f"cfg-{policy}", "policy": policy,
                     "max_extend_tokens": BUDGET})  # fmt: skip
    assert reply["type"] == "config", reply
    chats = []
    for i in range(CHATS):
        r = c.reply({"type": "submit", "id": f"{policy}-chat{i}", "ignore_eos": True,
                     "input_ids": ids(CHAT_PROMPT, seed + i), "max_tokens": CHAT_TOKENS})  # fmt: skip
        chats.append(r["uid"])
    for uid in chats:  # every chat is decoding
        c.until(lambda m, u=uid: m.get("uid") == u and m.get("event") == "first_token")
    r = c.reply({"type": "submit", "id": f"{policy}-long", "ignore_eos": True,
                 "input_ids": ids(LONG_PROMPT, seed + 99), "max_tokens": 4})  # fmt: skip
    long = r["uid"]
    for uid in [*chats, long]:
        c.until(lambda m, u=uid: m.get("uid") == u and m.get("event") == "finished")
    return {"chats": chats, "long": long}


@pytest.fixture(scope="module")
def recorded(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    trace = tmp_path_factory.mktemp("truth") / "run.jsonl"
    server = ApiServer(tiny_llama_dir, "--max-extend-tokens", str(BUDGET), "--cache-type",
                       "naive", "--trace", str(trace))  # fmt: skip
    try:
        c = server.client()
        runs = {
            "prefill_first": chats_meet_a_long_prompt(c, "prefill_first", 1000),
            "mixed": chats_meet_a_long_prompt(c, "mixed", 2000),
        }
        c.close()
        metrics = scrape(server)  # the exporter saw each message before any client did
    finally:
        stop(server)  # SIGTERM, which flushes the trace
    msgs = [json.loads(line) for line in trace.read_text().splitlines()]
    yield {"msgs": msgs, "runs": runs, "metrics": metrics, "seen": c.seen,
           "port_free_after_stop": port_is_free(server.port)}  # fmt: skip


def test_sigterm_frees_the_port_and_the_trace_holds_what_a_client_saw(recorded: dict) -> None:
    """A clean SIGTERM stop with the HTTP API on (`stop` checked its status and stderr); the
    SIGINT stop without it is test_server_lifecycle's."""
    assert recorded["port_free_after_stop"]
    msgs = recorded["msgs"]
    assert msgs[0]["type"] == "hello" and msgs[0]["engine"]["vocab_size"] == 49152
    broadcasts = ("step", "token", "request", "config")  # this run sets the policy
    assert {m["type"] for m in msgs[1:]} == set(broadcasts)
    assert msgs[1:] == [m for m in recorded["seen"] if m["type"] in broadcasts]


def test_finished_max_stall_is_the_protocols_stall(recorded: dict) -> None:
    msgs = recorded["msgs"]
    by_hand = stalls_by_hand(msgs)
    times = token_times(msgs)
    finished = finished_events(msgs)
    assert len(finished) == 2 * (CHATS + 1)
    for uid, ev in finished.items():
        gaps = by_hand[uid]
        assert ev["max_stall_seconds"] == (max(gaps) if gaps else None), uid
        # the token messages carry the same times as the steps that sampled them
        assert times[uid] == [t for _, t in _sampled(msgs, uid)]
        itl = [b - a for a, b in zip(times[uid], times[uid][1:], strict=False)]
        assert ev["max_itl_seconds"] == (max(itl) if itl else None)
    pf, mixed = recorded["runs"]["prefill_first"], recorded["runs"]["mixed"]
    # prefill-first: no chat decodes while the long prompt is chunked
    assert all(finished[u]["max_stall_seconds"] is not None for u in pf["chats"])
    assert all(finished[u]["max_stall_seconds"] is None for u in [*mixed["chats"], mixed["long"]])
    # a gap under mixed is long (a step carrying chunks is slower), but it is not a stall
    assert all(finished[u]["max_itl_seconds"] > 0 for u in mixed["chats"])


def test_metrics_endpoint_states_the_same_stalls(recorded: dict) -> None:
    by_hand = stalls_by_hand(recorded["msgs"])
    every = [g for gaps in by_hand.values() for g in gaps]
    s = recorded["metrics"]
    assert s["stepscope:decode_stall_seconds_count{}"] == len(every) > 0
    assert s["stepscope:decode_stall_seconds_sum{}"] == pytest.approx(sum(every), rel=1e-9)
    assert s["stepscope:decode_stall_max_seconds{}"] == max(every)


def _sampled(msgs: list[Msg], uid: int) -> list[tuple[int, float]]:
    return [
        (m["step"], m["t1"])
        for m in msgs
        if m["type"] == "step"
        for i in m["items"]
        if i["uid"] == uid and i["kind"] in ("prefill", "decode") and not i.get("wasted")
    ]


# ---- one trace, every consumer -----------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, Any]:
    """name → value for plain samples; name → [(le, cumulative count)] for histogram buckets."""
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                out.setdefault(sample.name, []).append((float(sample.labels["le"]), sample.value))
            else:
                out[sample.name] = sample.value
    return out


def bucket_bounds(buckets: list[tuple[float, float]], q: float) -> tuple[float, float]:
    """Where a histogram puts the linear-interpolated q-th percentile: between the lower edge of
    the bucket of its lower order statistic and the upper edge of its upper one's."""
    n = int(buckets[-1][1])
    pos = (n - 1) * q / 100
    lo_rank, hi_rank = int(pos) + 1, min(int(pos) + 2, n)  # 1-based ranks around the position

    def bucket(rank: int) -> tuple[float, float]:
        prev = 0.0
        for le, cum in buckets:
            if cum >= rank:
                return prev, le
            prev = le
        raise AssertionError("rank beyond the count")

    return bucket(lo_rank)[0], bucket(hi_rank)[1]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def llm(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Any:
    """The synchronous engine, and the overlapped one (a step's tokens read while the next runs,
    as on CUDA): each token's step number is its step record's either way."""
    from engine.llm import LLM

    return LLM(str(tiny_llama_dir), cache_type="naive", max_extend_tokens=BUDGET,
               overlap=request.param, progress=False)  # fmt: skip


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
def test_one_trace_gives_the_same_figures_everywhere(llm: Any, policy: str, tmp_path: Path) -> None:
    from app import compare
    from app.derive import headline
    from app.replay import Recording
    from app.state import EventStore
    from engine.server.metrics.prometheus import EngineMetrics
    from instrumentation.metrics import percentile
    from instrumentation.sampling import SamplingParams
    from instrumentation.sweep import RunTrace, summary_row

    # generate(): four chats and a long prompt at once; under prefill-first the chats that got
    # their first token before the prompt's chunks wait for them
    llm.set_config(max_extend_tokens=BUDGET, policy=policy)
    path = tmp_path / f"{policy}-{BUDGET}.jsonl"
    trace = RunTrace(path, llm.info.to_dict(), llm.config_dict(), llm.now())
    exporter = EngineMetrics("m")

    def hook(event: Any) -> None:
        msg = event.to_dict()
        trace(msg)  # the server's --trace
        exporter(msg)  # and its /metrics, fed as the publisher feeds them

    prompts = [ids(CHAT_PROMPT, 10 + i) for i in range(4)] + [ids(64, 20)]
    llm.add_event_hook(hook)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        llm.remove_event_hook(hook)
        trace.close()
    msgs = [json.loads(line) for line in path.read_text().splitlines()]

    gen_ttfts = [o["metrics"]["time_to_first_token_seconds"] for o in outs]
    gen_itls = [g for o in outs for g in o["metrics"]["inter_token_latency_seconds"]]
    gen_stalls = [o["metrics"]["max_stall_seconds"] for o in outs]
    gen = {
        "ttft_p50": percentile(gen_ttfts, 50),
        "itl_p99": percentile(gen_itls, 99),
        "worst_stall": max((s for s in gen_stalls if s is not None), default=None),
    }
    by_hand = stalls_by_hand(msgs)
    assert gen_stalls == [max(by_hand[o["uid"]], default=None) for o in outs]
    assert (gen["worst_stall"] is None) == (policy == "mixed")

    # the page: the live store folds the stream, the metric row summarizes its snapshot
    store = EventStore()
    for m in msgs:
        store.apply(m)
    snap = store.snapshot()
    h = headline(snap.steps, snap.requests, whole=True)
    steps = [m for m in msgs if m["type"] == "step"]
    assert h.summary.steps == len(steps) and h.scope.startswith("the whole recording")
    page = {"ttft_p50": h.ttft_p50, "itl_p99": h.itl_p99, "worst_stall": h.worst_stall}

    # replay compare (the recording against itself) and the sweep's summary row
    rows = {r["metric"]: r["A"] for r in compare.table(*[compare.side(
        Recording.from_messages(msgs, path.name, path))] * 2)}  # fmt: skip
    replay = {"ttft_p50": rows["TTFT p50 (s)"], "itl_p99": rows["ITL p99 (s)"],
              "worst_stall": rows["worst stall (s)"]}  # fmt: skip
    row = summary_row(policy, BUDGET, msgs)
    sweep = {"ttft_p50": row.ttft_p50_s, "itl_p99": row.itl_p99_s, "worst_stall": row.worst_stall_s}

    assert gen == page == replay == sweep

    # /metrics: the worst stall is stated exactly; histogram counts and sums are exact, and the
    # percentiles lie in the buckets the histograms put them in
    body, _ = exporter.render()
    s = parse_metrics(body.decode())
    assert s["stepscope:decode_stall_max_seconds"] == (gen["worst_stall"] or 0.0)
    stalls = [g for gaps in by_hand.values() for g in gaps]
    assert s["stepscope:decode_stall_seconds_count"] == len(stalls)
    assert s["stepscope:time_to_first_token_seconds_count"] == len(gen_ttfts)
    assert s["stepscope:time_to_first_token_seconds_sum"] == pytest.approx(sum(gen_ttfts))
    assert s["stepscope:inter_token_latency_seconds_count"] == len(gen_itls)
    assert s["stepscope:inter_token_latency_seconds_sum"] == pytest.approx(sum(gen_itls))
    lo, hi = bucket_bounds(s["stepscope:time_to_first_token_seconds_bucket"], 50)
    assert lo <= gen["ttft_p50"] <= hi
    lo, hi = bucket_bounds(s["stepscope:inter_token_latency_seconds_bucket"], 99)
    assert lo <= gen["itl_p99"] <= hi
