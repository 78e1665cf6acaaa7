"""Benchmarks of the engine server: instrumentation overhead, and a soak over the socket.

    python scripts/bench_server.py overhead [--model smollm2] [--pairs 3]
    # issue 27 on the H200: 64 requests of 512 + 256 tokens, 1 client, then 8 and /metrics
    python scripts/bench_server.py overhead --model assets/qwen3-0.6b --load-format dummy \
        --device cuda --policy mixed --budget 8192 --max-running 64 --lengths 512x64 \
        --max-tokens 256 --clients 8 --metrics-every 1
    python scripts/bench_server.py soak [--model tiny] [--requests 2000] [--overlap]

`overhead` runs the same workload on one engine, alternating rounds without and with the whole
server stack (event hook, the events serialized and sent to the API process, which folds them
and fans them out to one connected client in another process that reads and parses every
message; `--clients N` connects N of them, and `--metrics-every S` scrapes the API process's
/metrics every S seconds throughout), and prints the step-time ratio. `soak` starts
`python -m engine.server` and drives it over the WebSocket with random requests, budget and
policy changes and aborts, then asks the server to check its page accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from instrumentation.protocol import ENDED_STATES, POLICY_NAMES  # noqa: E402  (torch-free)


def tiny_model(dst: Path) -> Path:
    """A tiny random-weight Llama with the SmolLM2 tokenizer (what the tests use)."""
    from engine.checks.models import make_tiny
    from engine.models.loader import resolve

    return make_tiny("llama", dst, resolve("smollm2", progress=False).path)


def model_path(name: str, tmp: Path) -> str:
    return str(tiny_model(tmp / "tiny")) if name == "tiny" else name


# -- overhead ---------------------------------------------------------------------------------


@dataclass
class Round:
    mode: str
    steps: int = 0
    step_seconds: float = 0.0
    wall_seconds: float = 0.0


def reader(url: str) -> None:
    """The connected client of the overhead run: reads and parses everything until closed."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    count = 0
    with connect(url, max_size=None, compression=None) as ws:
        json.loads(ws.recv())
        print("connected", flush=True)
        try:
            while True:
                json.loads(ws.recv())
                count += 1
        except ConnectionClosed:
            pass
    print(count, flush=True)


def parse_lengths(text: str) -> list[int]:
    """'256,64,16' or '512x64' (64 prompts of 512 tokens), or both mixed: '512x8,16'."""
    out: list[int] = []
    for part in text.split(","):
        n, _, times = part.partition("x")
        out += [int(n)] * int(times or 1)
    return out


class Scraper:
    """GET a /metrics URL every `every` seconds on a thread, as Prometheus would."""

    def __init__(self, url: str, every: float) -> None:
        import threading

        self.url, self.every, self.count = url, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.every):
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                resp.read()
            self.count += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def overhead(args: argparse.Namespace) -> None:
    import torch

    from engine import LLM, SamplingParams
    from engine.server import build, build_parser

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        llm = LLM(path, max_running_req=args.max_running,
                  device=args.device, load_format=args.load_format, policy=args.policy,
                  max_extend_tokens=args.budget, progress=False)  # fmt: skip
        server = build(llm, build_parser().parse_args(["--model", path, "--port", "0",
                                                       "--http-port", "0"]))  # fmt: skip
        instrumented = False

        def hook(ev: Any) -> None:  # off during bare rounds: one call and a test per event
            if instrumented:
                server.loop.on_event(ev)

        def wait_hook() -> None:  # as the server's loop: events go out while the device works
            if instrumented:
                server.loop.flush()

        llm.add_event_hook(hook)
        if hasattr(llm, "add_wait_hook"):
            llm.add_wait_hook(wait_hook)
        if not server.start():  # the API process: WebSocket, HTTP and /metrics
            raise SystemExit("the API process did not start")
    scraper = None
    if args.metrics_every > 0:
        assert server.urls.get("http")
        scraper = Scraper(f"{server.urls['http']}/metrics", args.metrics_every)
    clients = []
    for _ in range(0 if args.no_client else args.clients):
        client = subprocess.Popen(
            [sys.executable, __file__, "read", str(server.urls["ws"])],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert client.stdout is not None and client.stdout.readline().strip() == "connected"
        clients.append(client)
    lengths = parse_lengths(args.lengths)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def run(mode: str, seed: int) -> Round:
        nonlocal instrumented
        instrumented = mode == "server"
        rng = random.Random(seed)  # fresh prompts each round: no prefix-cache hits
        for n in lengths:
            llm.submit([rng.randrange(3, llm.info.vocab_size) for _ in range(n)], params)
        rnd = Round(mode)
        start = time.perf_counter()
        while llm.has_work():
            t = time.perf_counter()
            record = server.loop.run_once() if instrumented else llm.step()
            if record is not None:
                rnd.step_seconds += time.perf_counter() - t
                rnd.steps += 1
        rnd.wall_seconds = time.perf_counter() - start
        server.loop.flush()  # as the server does when the engine goes idle
        return rnd

    run("bare", 0)  # warm-up
    rounds = []
    for k in range(args.pairs):
        order = ("bare", "server") if k % 2 == 0 else ("server", "bare")
        rounds += [run(mode, 1000 + 2 * k + j) for j, mode in enumerate(order)]
    if scraper is not None:
        scraper.stop()
    server.close()
    delivered = sum(int(c.communicate(timeout=60)[0].strip() or 0) for c in clients)

    print(f"\nmodel {llm.info.model} on {llm.info.device}, torch threads {torch.get_num_threads()}")
    print(
        f"workload per round: prompts of {args.lengths} tokens, {args.max_tokens} output tokens each"
    )
    print(f"{'mode':8} {'rounds':>6} {'steps':>6} {'median step ms':>15} {'median round s':>15}")
    for mode in ("bare", "server"):
        mine = [r for r in rounds if r.mode == mode]
        step_ms = statistics.median(1e3 * r.step_seconds / r.steps for r in mine)
        wall = statistics.median(r.wall_seconds for r in mine)
        print(f"{mode:8} {len(mine):6d} {mine[0].steps:6d} {step_ms:15.2f} {wall:15.3f}")
    # Each pair ran back to back, so its ratio is the least disturbed by other load on the host.
    pairs = [(rounds[i], rounds[i + 1]) for i in range(0, len(rounds), 2)]
    ratios = [
        (b.step_seconds if b.mode == "server" else a.step_seconds)
        / (a.step_seconds if a.mode == "bare" else b.step_seconds)
        for a, b in pairs
    ]
    print("step-time ratio server/bare per pair: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"median ratio: {statistics.median(ratios):.4f}")
    print(f"messages delivered to {len(clients)} connected client(s): {delivered}")
    if scraper is not None:
        print(f"/metrics scrapes during the rounds: {scraper.count}")


# -- soak -------------------------------------------------------------------------------------


def random_submit(rng: random.Random, max_seq: int, vocab: int, cid: str) -> dict[str, Any]:
    """One random `submit` of the soak's mix: 4% that can never fit, 3% with an out-of-range
    field, 13% text (half through the chat template), the rest random token ids (1 to half the
    context, most short); `max_tokens` 1 to 64; 30% sampled."""
    roll = rng.random()
    cmd: dict[str, Any] = {"type": "submit", "id": cid}
    if roll < 0.04:  # can never fit
        cmd["input_ids"] = [5] * (max_seq + rng.randrange(1, 100))
    elif roll < 0.07:  # out of range
        cmd |= {"prompt": "hi", rng.choice(["max_tokens", "top_p", "top_k"]): 0}
    elif roll < 0.20:  # text, sometimes through the chat template
        words = rng.choices(["the", "sea", "was", "calm", "and", "Paris", "is"], k=30)
        cmd |= {"prompt": " ".join(words), "chat": rng.random() < 0.5}
    else:
        n = int(rng.triangular(1, max_seq // 2, 16))
        cmd["input_ids"] = [rng.randrange(3, vocab) for _ in range(n)]
    cmd["max_tokens"] = cmd.get("max_tokens", rng.randrange(1, 65))
    if rng.random() < 0.3:
        cmd |= {"temperature": rng.uniform(0.5, 1.5), "top_k": rng.choice([-1, 5, 50]),
                "top_p": rng.uniform(0.5, 1.0), "seed": rng.randrange(2**31)}  # fmt: skip
    return cmd


@dataclass
class Soak:
    rng: random.Random
    vocab: int
    max_seq: int
    live: set[int] = field(default_factory=set)
    ended: list[int] = field(default_factory=list)
    ended_set: set[int] = field(default_factory=set)
    unanswered: int = 0
    backoff: bool = False  # the server said `capacity`: wait a moment before the next submit
    counts: Counter[str] = field(default_factory=Counter)

    def submit(self) -> dict[str, Any]:
        return random_submit(self.rng, self.max_seq, self.vocab, "s")

    def on_message(self, m: dict[str, Any]) -> None:
        kind = m["type"]
        if kind == "accepted":
            self.unanswered -= 1
            if m["uid"] not in self.ended_set:  # its events may come before the reply
                self.live.add(m["uid"])
            self.counts["accepted"] += 1
        elif kind == "error":
            if m["id"] == "s":
                self.unanswered -= 1
            self.counts[f"error {m['code']}"] += 1
            if m["code"] == "capacity":
                self.backoff = True
        elif kind == "request" and m["event"] in ENDED_STATES:
            self.live.discard(m["uid"])
            self.ended.append(m["uid"])
            self.ended_set.add(m["uid"])
            self.counts[m["event"]] += 1
        elif kind == "token":
            self.counts["tokens"] += 1
        elif kind == "config":
            self.counts["config"] += 1


async def soak_client(url: str, requests: int, seed: int, window: int) -> tuple[Soak, dict]:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, compression=None) as ws:
        hello = json.loads(await ws.recv())
        s = Soak(random.Random(seed), hello["engine"]["vocab_size"], hello["engine"]["max_seq_len"])
        stats: asyncio.Future[dict] = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for frame in ws:
                m = json.loads(frame)
                if m["type"] == "stats":
                    stats.set_result(m)
                    return
                s.on_message(m)

        reading = asyncio.create_task(read())
        for _ in range(requests):
            while len(s.live) + s.unanswered >= window:
                await asyncio.sleep(0.005)
            if s.backoff:
                s.backoff = False
                await asyncio.sleep(0.1)
            s.unanswered += 1
            await ws.send(json.dumps(s.submit()))
            if s.rng.random() < 0.05:
                budget = s.rng.choice([1, 2, 4, 16, 64, 256, 512, s.rng.randrange(1, 1024)])
                policy = s.rng.choice(POLICY_NAMES)
                await ws.send(json.dumps({"type": "set_config", "max_extend_tokens": budget,
                                          "policy": policy}))  # fmt: skip
            if s.rng.random() < 0.12:
                # Mostly requests in flight; sometimes one that has ended (`not_found`).
                pool = sorted(s.live) if s.rng.random() < 0.8 else s.ended
                if pool:
                    await ws.send(json.dumps({"type": "abort", "uid": s.rng.choice(pool)}))
        while s.live or s.unanswered:
            await asyncio.sleep(0.05)
        await ws.send(json.dumps({"type": "stats", "id": "final"}))
        await reading
        return s, stats.result()


def soak(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "engine.server", "--model", model_path(args.model, Path(tmp)),
               "--port", "0", "--http-port", "0", "--max-running-req", "16",
               "--max-waiting", str(args.max_waiting),
               "--max-seq-len", "1024", "--threads", str(args.threads),
               "--overlap" if args.overlap else "--no-overlap"]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().split(" at ", 1)[1].strip()
            start = time.perf_counter()
            s, stats = asyncio.run(soak_client(url, args.requests, args.seed, args.window))
            wall = time.perf_counter() - start
        finally:
            proc.terminate()
            code = proc.wait(timeout=60)
    c = s.counts
    rejected = c["error capacity"] + c["error too_large"] + c["error invalid_request"]
    rows = [
        ("requests submitted", args.requests),
        ("accepted", c["accepted"]),
        ("served (finished)", c["finished"]),
        ("aborted", c["aborted"]),
        ("rejected at submit", rejected),
        ("  capacity / too_large / invalid_request",
         f"{c['error capacity']} / {c['error too_large']} / {c['error invalid_request']}"),
        ("rejected later (request event)", c["rejected"]),
        ("aborts of ended uids (not_found)", c["error not_found"]),
        ("set_config broadcasts", c["config"]),
        ("tokens generated", c["tokens"]),
        ("engine steps", stats["steps"]),
        ("wall time s", f"{wall:.1f}"),
        ("integrity", stats["integrity"]),
        ("kv at the end (pages)", json.dumps(stats["kv"])),
        ("queue at the end", json.dumps(stats["queue"])),
        ("engine errors", stats["engine_errors"]),
        ("server exit status", code),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    ok = (
        stats["integrity"] == "ok" and stats["engine_errors"] == 0 and stats["kv"]["used"] == 0
        and stats["kv"]["reserved"] == 0 and c["accepted"] == c["finished"] + c["aborted"]
        + c["rejected"] and code == 0
    )  # fmt: skip
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    o = sub.add_parser("overhead", help="step time with the server stack vs the bare engine")
    o.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' or a model directory")
    o.add_argument("--pairs", type=int, default=3, help="bare/server round pairs")
    o.add_argument("--max-tokens", type=int, default=16)
    o.add_argument("--lengths", default="256,64,16,8,4", help="prompt lengths of one round")
    o.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    o.add_argument("--no-client", action="store_true", help="serve, but connect no client")
    o.add_argument("--clients", type=int, default=1, help="WebSocket clients that read it all")
    o.add_argument(
        "--metrics-every",
        type=float,
        default=0.0,
        help="scrape /metrics every this many seconds (0: never)",
    )
    o.add_argument("--device", default="cpu")
    o.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    o.add_argument("--policy", default="prefill_first")
    o.add_argument("--budget", type=int, default=256, help="max_extend_tokens")
    o.add_argument("--max-running", type=int, default=8)
    k = sub.add_parser("soak", help="random traffic over the socket, then an integrity check")
    k.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or a model directory")
    k.add_argument("--requests", type=int, default=2000)
    k.add_argument("--window", type=int, default=40, help="requests in flight at most")
    k.add_argument("--max-waiting", type=int, default=32, help="the server's --max-waiting")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--threads", type=int, default=1, help="the server's --threads")
    k.add_argument("--overlap", action="store_true", help="the server overlaps steps (as on CUDA)")
    r = sub.add_parser("read", help=argparse.SUPPRESS)
    r.add_argument("url")
    args = p.parse_args()
    if args.command == "read":
        reader(args.url)
        return 0
    if args.command == "overhead":
        overhead(args)
        return 0
    return soak(args)


if __name__ == "__main__":
    sys.exit(main())
