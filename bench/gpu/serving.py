"""serving: what serving costs on the GPU, by the two serving benchmarks at the decode rows'
shapes (Qwen3-0.6B's shape, random weights, 512-token prompts, policy mixed, budget 8,192):
the server stack and one WebSocket client against the bare engine (bench.server_overhead), and
HTTP streams against the engine alone (bench.http). Each runs in its own process, so its
engines' memory goes back to the device before the next section."""

from __future__ import annotations

import argparse
import subprocess
import sys

from bench.gpu.common import NEW_TOKENS, PROMPT_LEN, QWEN, REPO, Report

ENGINE = ["--model", str(QWEN), "--load-format", "dummy", "--device", "cuda", "--policy", "mixed",
          "--budget", "8192"]  # fmt: skip
RUNS = {
    "server_overhead": (
        f"The server and one client against the bare engine: 64 requests of {PROMPT_LEN} + "
        f"{NEW_TOKENS} tokens, 4 round pairs (ABBA)",
        ["--max-running", "64", "--lengths", f"{PROMPT_LEN}x64", "--max-tokens", str(NEW_TOKENS),
         "--pairs", "4"],
    ),
    "http": (
        f"HTTP streams against the engine alone, {PROMPT_LEN} + {NEW_TOKENS} tokens",
        ["--prompt-len", str(PROMPT_LEN), "--output-len", str(NEW_TOKENS), "--streams", "1,64",
         "--streams-per-client", "16"],
    ),
}  # fmt: skip


def run(r: Report, args: argparse.Namespace) -> None:
    for module, (title, flags) in RUNS.items():
        if r.left() < 120:
            r.say(f"(skipped {title}: past the deadline)")
            continue
        cmd = [sys.executable, "-m", f"bench.{module}", *ENGINE, *flags]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=max(60.0, min(r.left(), 600.0)))  # fmt: skip
        out = proc.stdout.strip()
        r.data.setdefault("serving", {})[module] = {"command": " ".join(cmd[1:]),
                                                    "rc": proc.returncode, "output": out}  # fmt: skip
        if proc.returncode != 0:
            out += "\n" + proc.stderr[-3000:]
        r.say(f"\n### {title}\n\n`python {' '.join(cmd[1:])}`\n\n{out}\n")
