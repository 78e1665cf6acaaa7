"""serving: what serving costs on the GPU, by the two serving benchmarks at the decode rows'
shapes (Qwen3-0.6B's shape, random weights, 512-token prompts, policy mixed, budget 8,192):
the server stack and one WebSocket client against the bare engine (bench.server_overhead), and
HTTP streams against the engine alone (bench.http)."""

from __future__ import annotations

import argparse
import statistics

from bench import http, server_overhead
from bench.gpu.common import NEW_TOKENS, PROMPT_LEN, QWEN, Report

ENGINE = ["--model", str(QWEN), "--load-format", "dummy", "--device", "cuda", "--policy", "mixed",
          "--budget", "8192"]  # fmt: skip


def run(r: Report, args: argparse.Namespace) -> None:
    parser = argparse.ArgumentParser()
    server_overhead.add_arguments(parser)
    o = server_overhead.overhead(parser.parse_args([
        *ENGINE, "--max-running", "64", "--lengths", f"{PROMPT_LEN}x64",
        "--max-tokens", str(NEW_TOKENS), "--pairs", "4",
    ]))  # fmt: skip
    r.table(
        f"The server and one client against the bare engine: 64 requests of {PROMPT_LEN} + "
        f"{NEW_TOKENS} tokens, 4 round pairs (ABBA)",
        ["mode", "rounds", "steps", "median step ms", "median round s"],
        o["rows"],
    )
    r.say(f"Server / bare step time per pair: {', '.join(f'{x:.3f}' for x in o['server_over_bare'])}"
          f"; median {statistics.median(o['server_over_bare']):.3f}. Messages delivered to the "
          f"client: {o['delivered']}.")  # fmt: skip
    r.data["server_overhead"] = o
    if r.left() < 120:
        r.say("(skipped HTTP streams: past the deadline)")
        return
    tables = http.run(http.build_parser().parse_args([
        *ENGINE, "--prompt-len", str(PROMPT_LEN), "--output-len", str(NEW_TOKENS),
        "--streams", "1,64", "--streams-per-client", "16",
    ]))  # fmt: skip
    for label, results in tables:
        r.table(
            f"HTTP streams ({label}) against the engine alone, {PROMPT_LEN} + {NEW_TOKENS} tokens",
            ["streams", "engine step ms", "engine tok/s", "HTTP tok/s", "HTTP/engine",
             "ITL p50 ms", "ITL p99 ms", "p99 / step", "engine ITL p99 ms",
             "HTTP p99 / engine p99", "steady ITL p99 ms: HTTP / engine",
             "steady HTTP p99 / step"],
            [http.result_row(x) for x in results],
        )  # fmt: skip
        r.data.setdefault("http", {})[label] = [http.result_row(x) for x in results]
