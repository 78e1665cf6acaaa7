"""What does serving cost the engine? The same decode workload on one engine, alternating
rounds without and with the whole server stack, and the step-time ratio.

    python -m bench.server_overhead                     # SmolLM2 on CPU, 3 round pairs
    python -m bench.server_overhead --model assets/qwen3-0.6b --load-format dummy \
        --device cuda --policy mixed --budget 8192 --max-running 64 --lengths 512x64 \
        --max-tokens 256 --clients 8 --metrics-every 1

With the server: the event hook, the events serialized and sent to the API process, which folds
them and fans them out to a connected client in another process that reads and parses every
message; `--clients N` connects N of them (`--no-client`: none), and `--metrics-every S` scrapes
the API process's /metrics every S seconds throughout. Rounds alternate bare/server in ABBA
order, so a drift of the machine's speed hits both alike.

`--against no-delays`: what naming the delays costs. The bare rounds are served too, by a second
server over the same engine started with `--no-delays` (no `delay` in end events, none on
/metrics); both get the same clients and scrapes, so the ratio is the attribution's alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import model_path, table

ROOT = Path(__file__).resolve().parents[1]


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


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Run the round pairs; print the table and return its figures."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        return _overhead(args, model_path(args.model, Path(tmp)))


def _overhead(args: argparse.Namespace, path: str) -> dict[str, Any]:
    import torch

    from bench.gpu.common import fold_random_ids
    from engine import LLM, SamplingParams
    from engine.server import build, build_parser

    fold_random_ids(args.load_format)

    llm = LLM(path, max_running_req=args.max_running,
              device=args.device, load_format=args.load_format, policy=args.policy,
              max_extend_tokens=args.budget, progress=False)  # fmt: skip
    base_argv = ["--model", path, "--port", "0", "--http-port", "0"]
    server = build(llm, build_parser().parse_args(base_argv))
    # the baseline: the engine alone, or a second server that names no delays
    base = (build(llm, build_parser().parse_args([*base_argv, "--no-delays"]))
            if args.against == "no-delays" else None)  # fmt: skip
    served = [s for s in (server, base) if s is not None]
    active: Any = None  # the server of this round; None: the engine alone

    def hook(ev: Any) -> None:  # off during bare rounds: one call and a test per event
        if active is not None:
            active.loop.on_event(ev)

    def wait_hook() -> None:  # as the server's loop: events go out while the device works
        if active is not None:
            active.loop.flush()

    llm.add_event_hook(hook)
    llm.add_wait_hook(wait_hook)
    for s in served:
        if not s.start():  # the API process: WebSocket, HTTP and /metrics
            raise SystemExit("the API process did not start")
    scrapers = []
    if args.metrics_every > 0:
        for s in served:
            assert s.urls.get("http")
            scrapers.append(Scraper(f"{s.urls['http']}/metrics", args.metrics_every))
    clients = []
    for s in served:
        for _ in range(0 if args.no_client else args.clients):
            client = subprocess.Popen(
                [sys.executable, "-m", "bench.server_overhead", "--read", str(s.urls["ws"])],
                stdout=subprocess.PIPE, text=True, cwd=ROOT,
            )  # fmt: skip
            assert client.stdout is not None and client.stdout.readline().strip() == "connected"
            clients.append(client)
    lengths = parse_lengths(args.lengths)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def run(mode: str, seed: int) -> Round:
        nonlocal active
        active = server if mode == "server" else base
        rng = random.Random(seed)  # fresh prompts each round: no prefix-cache hits
        for n in lengths:
            llm.submit([rng.randrange(3, llm.info.vocab_size) for _ in range(n)], params)
        rnd = Round(mode)
        start = time.perf_counter()
        while llm.has_work():
            t = time.perf_counter()
            record = active.loop.run_once() if active is not None else llm.step()
            if record is not None:
                rnd.step_seconds += time.perf_counter() - t
                rnd.steps += 1
        rnd.wall_seconds = time.perf_counter() - start
        if active is not None:
            active.loop.flush()  # as the server does when the engine goes idle
        return rnd

    run("bare", 0)  # warm-up
    rounds = []
    for k in range(args.pairs):
        order = ("bare", "server") if k % 2 == 0 else ("server", "bare")
        rounds += [run(mode, 1000 + 2 * k + j) for j, mode in enumerate(order)]
    for scraper in scrapers:
        scraper.stop()
    for s in served:
        s.close()
    delivered = sum(int(c.communicate(timeout=60)[0].strip() or 0) for c in clients)

    print(f"\nmodel {llm.info.model} on {llm.info.device}, torch threads {torch.get_num_threads()}; "
          f"per round: prompts of {args.lengths} tokens, {args.max_tokens} output tokens each\n")  # fmt: skip
    rows = []
    for mode in ("bare", "server"):
        mine = [r for r in rounds if r.mode == mode]
        step_ms = statistics.median(1e3 * r.step_seconds / r.steps for r in mine)
        wall = statistics.median(r.wall_seconds for r in mine)
        label = "server --no-delays" if mode == "bare" and base is not None else mode
        rows.append([label, len(mine), mine[0].steps, step_ms, wall])
    print(table(["mode", "rounds", "steps", "median step ms", "median round s"], rows))
    # Each pair ran back to back, so its ratio is the least disturbed by other load on the host.
    pairs = [(rounds[i], rounds[i + 1]) for i in range(0, len(rounds), 2)]
    ratios = [
        (b.step_seconds if b.mode == "server" else a.step_seconds)
        / (a.step_seconds if a.mode == "bare" else b.step_seconds)
        for a, b in pairs
    ]
    print(
        f"\nstep-time ratio server/{args.against} per pair: " + " ".join(f"{r:.3f}" for r in ratios)
    )
    print(f"median ratio: {statistics.median(ratios):.4f}")
    print(f"messages delivered to {len(clients)} connected client(s): {delivered}")
    if scrapers:
        print(f"/metrics scrapes during the rounds: {sum(s.count for s in scrapers)}")
    return {
        "rows": rows,
        "server_over_bare": ratios,
        "median_ratio": statistics.median(ratios),
        "delivered": delivered,
        "clients": len(clients),
    }


def add_arguments(o: argparse.ArgumentParser) -> None:
    o.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' or a model directory")
    o.add_argument("--device", default="cpu")
    o.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    o.add_argument("--pairs", type=int, default=3, help="bare/server round pairs")
    o.add_argument("--max-tokens", type=int, default=16)
    o.add_argument("--lengths", default="256,64,16,8,4", help="prompt lengths of one round: "
                   "'256,64' or '512x64' (64 prompts of 512 tokens), or both mixed")  # fmt: skip
    o.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    o.add_argument("--no-client", action="store_true", help="serve, but connect no client")
    o.add_argument(
        "--against",
        choices=("bare", "no-delays"),
        default="bare",
        help="the baseline rounds: the engine alone, or a server with --no-delays",
    )
    o.add_argument("--clients", type=int, default=1, help="WebSocket clients that read it all")
    o.add_argument(
        "--metrics-every",
        type=float,
        default=0.0,
        help="scrape /metrics every this many seconds (0: never)",
    )
    o.add_argument("--policy", default="prefill_first")
    o.add_argument("--budget", type=int, default=256, help="max_extend_tokens")
    o.add_argument("--max-running", type=int, default=8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.server_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.add_argument("--read", metavar="URL", help=argparse.SUPPRESS)  # a client process
    args = p.parse_args(argv)
    if args.read:
        reader(args.read)
        return 0
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    overhead(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
