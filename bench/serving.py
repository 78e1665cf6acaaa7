"""Serving benchmark with a standard load generator (guidellm) against `python -m engine.server`.

    python -m bench.serving --model smollm2 --policy mixed --requests 200 --rate 1.5 \\
        --prompt-tokens 64 --output-tokens 16 --out out/serving-cpu-mixed

It starts the server (WebSocket and HTTP API on free ports, `--trace` into OUT), sends one
warm-up request, scrapes `/metrics`, runs guidellm (Poisson arrivals at --rate, --requests
synthetic prompts of --prompt-tokens, --output-tokens each with ignore_eos, streamed through
/v1/completions), scrapes `/metrics` again and prints the tool's TTFT and ITL percentiles beside
the server's for the same window: its Prometheus histograms (the two scrapes' difference, the
quantiles interpolated within buckets as Prometheus' histogram_quantile does; the means are
exact) and exact figures from the trace. A page pointed at the printed WebSocket URL watches
the run. The table is also written to OUT/table.md, the tool's report to OUT/guidellm.json.

guidellm stays out of the project's environment (it brings datasets, sanic, faker, ...). If
this interpreter can import it (say, wheels installed with `pip install --target DIR` and DIR on
PYTHONPATH), that is used; otherwise a virtual environment --tool-env (.venv-bench) is made that
sees this environment's packages (torch, transformers, numpy are not installed twice) and
guidellm is installed there, from PyPI or, with --wheels DIR, from wheel files only (a machine
without internet: `pip download guidellm==0.8.1 -d DIR` where there is one).

On a CUDA machine, the Qwen3-0.6B shape with random weights:

    python -m bench.serving --model assets/qwen3-0.6b --load-format dummy --device cuda \\
        --requests 400 --rate 20 --prompt-tokens 512 --output-tokens 128 --policy mixed \\
        --max-running-req 64 --max-extend-tokens 2048 --server-arg=--max-seq-len \\
        --server-arg=2048 --out out/serving-gpu-mixed
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import queue
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from instrumentation.fold import Fold
from instrumentation.metrics import gaps, percentile  # torch-free
from instrumentation.protocol import POLICY_NAMES

ROOT = Path(__file__).resolve().parents[1]
GUIDELLM = "guidellm==0.8.1"
QUANTILES = (50, 90, 99)


# -- the load generator's environment ------------------------------------------------------------


def tool_command(args: argparse.Namespace) -> list[str]:
    """How to run guidellm: from this interpreter if it has it, else from --tool-env."""
    if importlib.util.find_spec("guidellm") is not None and _works(sys.executable):
        return [sys.executable, "-m", "guidellm"]
    env = Path(args.tool_env)
    py = env / "bin" / "python"
    if not py.exists() or not _works(str(py)):
        print(f"bench.serving: installing {GUIDELLM} into {env} ...", file=sys.stderr, flush=True)
        _run([sys.executable, "-m", "venv", str(env)])
        # this environment's packages are seen from the tool's (a .pth file), so torch,
        # transformers and numpy are not installed a second time
        here = sysconfig.get_paths()["purelib"]
        there = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        Path(there, "zz-stepscope-base.pth").write_text(here + "\n")
        source = ["--no-index", "--find-links", args.wheels] if args.wheels else []
        _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *source,
              GUIDELLM])  # fmt: skip
    return [str(py), "-m", "guidellm"]


def _works(python: str) -> bool:
    """guidellm starts under `python` (its imports all resolve)."""
    cmd = [python, "-m", "guidellm", "--version"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _run(cmd: list[str], check: bool = True) -> int:
    return subprocess.run(cmd, check=check).returncode


# -- the server --------------------------------------------------------------------------------


class Server:
    """`python -m engine.server` with the HTTP API on a free port; its output goes to a log."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        cmd = [sys.executable, "-m", "engine.server", "--model", args.model,
               "--device", args.device, "--port", "0", "--http-port", "0",
               "--policy", args.policy, "--max-extend-tokens", str(args.max_extend_tokens),
               "--max-running-req", str(args.max_running_req), "--max-waiting", "100000",
               "--load-format", args.load_format, "--trace", str(out / "trace.jsonl"),
               *args.server_arg]  # fmt: skip
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.log = open(out / "server.log", "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env)  # fmt: skip
        self.ws_url, self.http_url = self._ready()

    def _ready(self, timeout: float = 900) -> tuple[str, str]:
        # a thread reads stdout to its end: two ready lines may arrive in one read, which a
        # select() on the pipe would not see as the second; and a full pipe would block the
        # server
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        urls: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while len(urls) < 2:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:  # EOF (the server died) or the timeout
                self.stop()
                raise SystemExit(f"the server did not start; see {self.log.name}")
            if line.startswith("stepscope engine ready at "):
                urls["ws"] = line.split(" at ", 1)[1].strip()
            elif line.startswith("stepscope HTTP API at "):
                urls["http"] = line.split(" at ", 1)[1].strip()
        return urls["ws"], urls["http"]

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.http_url + path, timeout=60) as resp:
            return resp.read()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.http_url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- Prometheus histograms ----------------------------------------------------------------------


@dataclass(frozen=True)
class Hist:
    """One histogram's change between two scrapes: cumulative bucket counts, sum and count."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), ascending, +Inf last
    sum: float
    count: float

    def quantile(self, q: float) -> float | None:
        """As Prometheus' histogram_quantile: linear within the bucket that holds rank q*count."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):  # in the +Inf bucket: the highest finite bound
                    return lower
                return lower + (le - lower) * (rank - below) / max(cum - below, 1e-12)
            lower, below = le, cum
        return lower

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None


def scrape(text: str) -> dict[str, dict[str, Any]]:
    """stepscope histograms from /metrics text: name → {"buckets": {le: n}, "sum", "count"}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                h = out.setdefault(s.name.removesuffix("_bucket"), {"buckets": {}})
                h["buckets"][float(s.labels["le"])] = s.value
            elif s.name.endswith(("_sum", "_count")):
                name, _, part = s.name.rpartition("_")
                out.setdefault(name, {"buckets": {}})[part] = s.value
            else:
                out.setdefault(s.name, {})["value"] = s.value
    return out


def delta(before: dict[str, Any], after: dict[str, Any], name: str) -> Hist:
    a, b = after[name], before.get(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
    les = sorted(a["buckets"])
    return Hist(
        tuple((le, a["buckets"][le] - b["buckets"].get(le, 0.0)) for le in les),
        a["sum"] - b.get("sum", 0.0),
        a["count"] - b.get("count", 0.0),
    )


# -- the run -----------------------------------------------------------------------------------


def scenario(args: argparse.Namespace, target: str, model: str, tokenizer: str) -> dict:
    data: dict[str, Any] = {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                            "output_tokens": args.output_tokens}  # fmt: skip
    if args.prompt_stdev:
        data.update(prompt_tokens_stdev=args.prompt_stdev, prompt_tokens_min=8,
                    prompt_tokens_max=2 * args.prompt_tokens)  # fmt: skip
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": target,
                "model": model,
                "request_format": "/v1/completions",
                "http2": False,
            },  # fmt: skip
            "profile": {"kind": "poisson", "rate": args.rate},
            "data": [data],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "constraints": [{"kind": "max_requests", "count": args.requests}],
            "seed": {"kind": "static", "value": args.seed},
        }
    }


def default_tokenizer(model: str) -> str:
    path = Path(model)
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return str(path.resolve())
    from engine.models.loader import resolve  # the bundled model (its converted directory)

    return str(resolve("smollm2", progress=False).path)


def tool_figures(report: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    m = report["benchmarks"][0]["metrics"]

    def stats(key: str) -> dict[str, float | None]:
        s = m[key]["successful"]
        p = s["percentiles"]
        return {"p50": p["p50"] / 1000, "p90": p["p90"] / 1000, "p99": p["p99"] / 1000,
                "mean": s["mean"] / 1000, "n": s["count"]}  # fmt: skip

    return {"ttft": stats("time_to_first_token_ms"), "itl": stats("inter_token_latency_ms")}


def trace_figures(path: Path, after_uid: int) -> dict[str, dict[str, float | None]]:
    """Exact server-side figures from the trace, for the requests after the warm-up."""
    fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62)
    with open(path) as f:
        for line in f:
            fold.apply(json.loads(line))
    ttft, pooled, weighted = [], [], []
    for rec in fold.requests():
        if rec.uid <= after_uid or rec.t_first_token is None or rec.t_queued is None:
            continue
        ttft.append(rec.t_first_token - rec.t_queued)
        own = gaps(rec.token_times)
        pooled += own
        if own:  # guidellm's ITL: each request's mean gap, once per gap (token-weighted)
            weighted += [sum(own) / len(own)] * len(own)

    def stats(xs: list[float]) -> dict[str, float | None]:
        out: dict[str, float | None] = {f"p{q}": percentile(xs, q) for q in QUANTILES}
        out.update(mean=sum(xs) / len(xs) if xs else None, n=len(xs))
        return out

    return {"ttft": stats(ttft), "itl": stats(pooled), "itl_req": stats(weighted)}


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    def ms(x: Any) -> str:
        return "–" if x is None else f"{1000 * x:.1f}"

    lines = ["| figure | source | p50 ms | p90 ms | p99 ms | mean ms | n |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, s in rows:
        figure, source = label.split(": ", 1)
        n = s.get("n")
        lines.append(f"| {figure} | {source} | {ms(s['p50'])} | {ms(s['p90'])} | "
                     f"{ms(s['p99'])} | {ms(s['mean'])} | {'' if n is None else int(n)} |")  # fmt: skip
    return "\n".join(lines)


def hist_row(h: Hist) -> dict[str, Any]:
    return {"p50": h.quantile(0.5), "p90": h.quantile(0.9), "p99": h.quantile(0.99),
            "mean": h.mean, "n": h.count}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tool = tool_command(args)
    server = Server(args, out)
    print(f"bench.serving: server at {server.ws_url} (the page can watch it) and "
          f"{server.http_url}", flush=True)  # fmt: skip
    try:
        model = json.loads(server.get("/v1/models"))["data"][0]["id"]
        warm = server.post("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4})
        warm_uid = int(warm["id"].split("-")[1])
        before = scrape(server.get("/metrics").decode())
        (out / "scenario.json").write_text(
            json.dumps(
                scenario(
                    args, server.http_url, model, args.tokenizer or default_tokenizer(args.model)
                ),
                indent=1,
            )  # fmt: skip
        )
        env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": str(args.tool_workers)}
        cmd = [*tool, "run", "-c", str(out / "scenario.json"), "--disable-progress",
               "--output", f"kind=json,path={out / 'guidellm.json'}",
               "--output", "kind=console"]  # fmt: skip
        start = time.monotonic()
        with open(out / "guidellm.log", "w") as log:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        wall = time.monotonic() - start
        after = scrape(server.get("/metrics").decode())
        if code != 0:
            print(f"bench.serving: guidellm failed ({code}); see {out / 'guidellm.log'}")
            return code
    finally:
        server.stop()

    report = json.loads((out / "guidellm.json").read_text())
    tool_stats = tool_figures(report)
    exact = trace_figures(out / "trace.jsonl", warm_uid)
    p = "stepscope:"
    rows = [
        ("TTFT: guidellm (client)", tool_stats["ttft"]),
        ("TTFT: /metrics histogram", hist_row(delta(before, after, p + "time_to_first_token_seconds"))),
        ("TTFT: trace (exact)", exact["ttft"]),
        ("ITL: guidellm (per-request mean, token-weighted)", tool_stats["itl"]),
        ("ITL: trace, same definition", exact["itl_req"]),
        ("ITL: /metrics histogram (every gap)", hist_row(delta(before, after, p + "inter_token_latency_seconds"))),
        ("ITL: trace (every gap, exact)", exact["itl"]),
        ("decode stall: /metrics histogram", hist_row(delta(before, after, p + "decode_stall_seconds"))),
    ]  # fmt: skip
    gen = (
        after[p + "generation_tokens_total"]["value"]
        - before[p + "generation_tokens_total"]["value"]
    )
    steps = delta(before, after, p + "iteration_tokens_total")
    m = report["benchmarks"][0]["metrics"]
    head = (
        f"model {args.model} on {args.device}, policy {args.policy}, "
        f"max_extend_tokens {args.max_extend_tokens}; guidellm {args.requests} requests, Poisson "
        f"{args.rate}/s, prompt {args.prompt_tokens} ± {args.prompt_stdev}, output "
        f"{args.output_tokens} tokens; {wall:.0f} s; {int(steps.count)} engine steps, "
        f"{gen:.0f} tokens generated (server), "
        f"{m['output_token_count']['successful']['total_sum']:.0f} received (guidellm), "
        f"{m['request_totals']['errored']} errored"
    )
    text = head + "\n\n" + table(rows) + "\n"
    (out / "table.md").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--model", default="smollm2")
    add("--device", default="cpu")
    add("--load-format", default="auto", choices=("auto", "dummy"))
    add("--policy", default="prefill_first", choices=POLICY_NAMES)
    add("--max-extend-tokens", type=int, default=256)
    add("--max-running-req", type=int, default=32)
    add("--threads", type=int, default=None, help="torch CPU threads of the server")
    add("--server-arg", action="append", default=[], help="more engine.server arguments")
    add("--requests", type=int, default=200)
    add("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    add("--prompt-tokens", type=int, default=64)
    add("--prompt-stdev", type=int, default=0)
    add("--output-tokens", type=int, default=16)
    add("--seed", type=int, default=42)
    add("--tokenizer", default=None, help="for guidellm's synthetic prompts (default: the model's)")
    add("--out", default="out/bench-serving")
    add("--tool-env", default=str(ROOT / ".venv-bench"))
    add("--tool-workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    add("--wheels", default=None, help="install guidellm from these wheel files only")
    args = p.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
