"""Which gateway policy wins: one workload of chats on shared system prompts, sent through
SGLang's Model Gateway in front of the same replicas under each routing policy in turn.

    python -m bench.fleet --replicas 2 --policies round_robin,power_of_two,cache_aware \
        -- --model smollm2 --threads 1

Before each policy every replica's prefix cache is flushed (`/flush_cache`) and the gateway is
restarted, so each policy starts cold on the same replicas. Per policy it prints the prefix-cache
hit rate (prompt tokens served from the cache, from the replicas' own /metrics), the requests
each replica served, TTFT and ITL p50/p99 (client side, streamed; per-request figures by
`instrumentation.metrics`) and output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine.server.fleet import ROUTER_POLICIES, Fleet, free_port
from instrumentation.metrics import percentile, request_metrics

WORDS = ("river stone light quiet seven paper north glass bread field cloud iron salt "
         "window garden letter market bridge winter copper").split()  # fmt: skip


@dataclass(frozen=True, slots=True)
class PolicyRow:
    policy: str
    requests: int
    per_replica: list[int]
    hit_rate: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    output_tok_s: float


def workload(n: int, systems: int, system_words: int, seed: int) -> list[str]:
    """`n` chat prompts, each a shared system prompt (one of `systems`) and its own question."""
    rng = random.Random(seed)
    heads = [f"You are assistant {k}. " + " ".join(rng.choice(WORDS) for _ in range(system_words))
             for k in range(systems)]  # fmt: skip
    return [
        rng.choice(heads) + "\nUser: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "?"
        for _ in range(n)
    ]


def scrape(http: str) -> dict[str, float]:
    with urllib.request.urlopen(http + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def stream_one(gateway: str, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """Send one streamed completion; (time sent, each token's arrival time)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(gateway + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.monotonic()
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("finish_reason") is None:
                times.append(time.monotonic())  # one chunk per token
    return t0, times


def warm_up(fleet: Fleet, prompt: str) -> None:
    """One short request straight to each replica before any policy is timed: a fresh engine's
    first steps compile kernels (FlashInfer's JIT on CUDA), which the first policy would pay."""
    for p in fleet.procs:
        with urllib.request.urlopen(p.http + "/v1/models") as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        stream_one(p.http or "", model, prompt, 4)


def run_policy(
    fleet: Fleet, policy: str, prompts: list[str], inflight: int, max_tokens: int
) -> PolicyRow:
    for p in fleet.procs:
        urllib.request.urlopen(urllib.request.Request(p.http + "/flush_cache", method="POST"))
    gateway = fleet.start_gateway(policy)
    with urllib.request.urlopen(gateway + "/v1/models") as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    before = [scrape(p.http or "") for p in fleet.procs]
    t_start = time.monotonic()
    with ThreadPoolExecutor(inflight) as pool:
        results = list(pool.map(lambda pr: stream_one(gateway, model, pr, max_tokens), prompts))
    wall = time.monotonic() - t_start
    after = [scrape(p.http or "") for p in fleet.procs]

    def delta(name: str, i: int) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)

    n = len(fleet.procs)
    queries = sum(delta("stepscope:prefix_cache_queries_total", i) for i in range(n))
    hits = sum(delta("stepscope:prefix_cache_hits_total", i) for i in range(n))
    per_replica = [int(delta("stepscope:request_success_total", i)) for i in range(n)]
    ttfts: list[float] = []
    itls: list[float] = []
    for t0, times in results:
        m = request_metrics(t0, None, times, None)  # a client sees tokens, not steps
        if m["time_to_first_token_seconds"] is not None:
            ttfts.append(m["time_to_first_token_seconds"])
        itls.extend(m["inter_token_latency_seconds"])
    return PolicyRow(
        policy=policy, requests=len(prompts), per_replica=per_replica,
        hit_rate=hits / queries if queries else None,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50), itl_p99_s=percentile(itls, 99),
        output_tok_s=sum(len(t) for _, t in results) / wall,
    )  # fmt: skip


def fmt(v: float | None, scale: float = 1000.0, unit: str = " ms") -> str:
    return "-" if v is None else f"{v * scale:.0f}{unit}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_args = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet",
        usage="python -m bench.fleet [options] -- ENGINE_ARGS...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policies", default="round_robin,power_of_two,cache_aware")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--systems", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gpus", default=None, help="CUDA devices to deal replicas to (e.g. 0,0,0,0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    for p in policies:
        if p not in ROUTER_POLICIES:
            ap.error(f"unknown policy {p!r}; one of {ROUTER_POLICIES}")
    prompts = workload(args.requests, args.systems, args.system_words, args.seed)
    fleet = Fleet(args.replicas, engine_args, router_policy=None, gateway_port=free_port(),
                  gpus=args.gpus.split(",") if args.gpus else None)  # fmt: skip
    rows: list[PolicyRow] = []
    with fleet:
        warm_up(fleet, prompts[0])
        for policy in policies:
            rows.append(run_policy(fleet, policy, prompts, args.inflight, args.max_tokens))
    print(f"\n{args.requests} requests on {args.systems} shared system prompts, "
          f"{args.inflight} in flight, {args.max_tokens} tokens each, {args.replicas} replicas")  # fmt: skip
    print(
        "| policy | per replica | prefix-cache hit rate | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        hit = "-" if r.hit_rate is None else f"{r.hit_rate:.1%}"
        print(f"| {r.policy} | {' / '.join(map(str, r.per_replica))} | {hit} | {fmt(r.ttft_p50_s)} "
              f"| {fmt(r.ttft_p99_s)} | {fmt(r.itl_p50_s)} | {fmt(r.itl_p99_s)} "
              f"| {r.output_tok_s:.1f} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
