"""Is stepscope as fast as vLLM? A real vLLM (its CPU wheel) against stepscope on the same
model and load, with the tokens compared.

    python -m bench.vs_vllm --runs 3             # SmolLM2, float32
    python -m bench.vs_vllm --runs 1 --only stepscope

The load: 24 streamed `/v1/completions`, 8 in flight, 32 tokens each (greedy, ignore_eos),
prompts of 40 to 400 tokens given as token ids (the same ids to both servers), budget 2,048
tokens per step on both (vLLM's CPU default `--max-num-batched-tokens`), 8 running at most
(`--max-num-seqs 8` / `--max-running-req 8`), float32. Both servers are started and warmed with
one request; then the runs alternate, vLLM's run i then stepscope's, the other server idle.

vLLM comes from its own venv (`--vllm-venv`: $STEPSCOPE_VLLM_VENV, default
~/.cache/stepscope/vllm-venv), made by scripts/setup_vllm.sh when it has no vLLM. Reported per
run: output tok/s (tokens received over the run's wall time), TTFT p50, ITL p50 / p99 as the
client saw them; then the ratios, and whether the greedy completions are identical token for
token between the two servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.sse import completion_events
from instrumentation.metrics import gaps, percentile

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = os.environ.get(
    "STEPSCOPE_VLLM_VENV", str(Path.home() / ".cache" / "stepscope" / "vllm-venv")
)
WORDS = ("river stone light quiet seven paper north glass bread window garden silver market "
         "winter castle forest letter number ocean signal").split()  # fmt: skip


@dataclass
class Run:
    server: str
    wall_s: float
    tokens: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, s) per step
    other_cores: float = 0.0  # CPU used by other processes during the run, in cores
    loadavg: float = 0.0  # the machine's 1-minute load average at the run's end

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def prompts(tokenizer_dir: Path, n: int, seed: int = 0) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(40, 400)
        text = " ".join(rng.choice(WORDS) for _ in range(target))
        out.append(tok.encode(text)[:target])
    return out


async def one(host: str, port: int, model: str, ids: list[int], n_out: int, run: Run) -> None:
    body = {"model": model, "prompt": ids, "max_tokens": n_out, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    sent, times, text = time.perf_counter(), [], []
    async for now, data in completion_events(host, port, body):
        if data.startswith(b"{"):
            for choice in json.loads(data).get("choices", []):
                if choice.get("text"):
                    times.append(now)
                    text.append(choice["text"])
    if times:
        run.ttft.append(times[0] - sent)
        run.itl += gaps(times)
    run.tokens += len(times)
    run.texts.append("".join(text))


async def load(url: str, model: str, ps: list[list[int]], n_out: int, in_flight: int,
               name: str) -> Run:  # fmt: skip
    host, port = url.removeprefix("http://").rsplit(":", 1)
    run = Run(name, 0.0, 0)
    runs = [Run(name, 0.0, 0) for _ in ps]  # one per request, so texts keep prompt order
    gate = asyncio.Semaphore(in_flight)
    t0 = time.perf_counter()

    async def gated(i: int) -> None:
        async with gate:
            await one(host, int(port), model, ps[i], n_out, runs[i])

    await asyncio.gather(*(gated(i) for i in range(len(ps))))
    run.wall_s = time.perf_counter() - t0
    for r in runs:
        run.tokens += r.tokens
        run.ttft += r.ttft
        run.itl += r.itl
        run.texts += r.texts
    return run


def ensure_vllm(venv: Path) -> Path:
    """vLLM's CPU wheel in its own venv: scripts/setup_vllm.sh makes it once (and leaves a
    working one alone)."""
    python = venv / "bin" / "python"
    if not python.exists():
        env = {**os.environ, "STEPSCOPE_VLLM_VENV": str(venv)}
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm.sh")], env=env, check=True)
    return python


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 900) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("the server was not ready in time")


def start(name: str, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> Server:
    port = args.port + (0 if name == "vllm" else 1)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    log = log_dir / f"{name}.log"
    if name == "vllm":
        python = ensure_vllm(Path(args.vllm_venv))
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs",
               str(args.in_flight), "--max-num-batched-tokens", str(args.budget)]  # fmt: skip
        if args.step_log:
            cmd.append("--enable-logging-iteration-details")
        model = "bench"
    else:
        cmd = [sys.executable, "-m", "engine.server", "--model", str(model_dir), "--port", "0",
               "--http-port", str(port), "--dtype", "float32", "--max-running-req",
               str(args.in_flight), "--max-extend-tokens", str(args.budget), "--policy",
               args.policy, "--threads", str(args.threads), "--max-seq-len", "2048"]  # fmt: skip
        if args.step_log:  # every message, tokens too: it costs the server some CPU
            cmd += ["--trace", str(log_dir / "stepscope-trace.jsonl")]
        model = model_dir.name
    out = log.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, url)
    except BaseException:
        proc.terminate()
        raise
    return Server(name, proc, url, model, log_dir, args.step_log)


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    model: str
    log_dir: Path
    step_log: bool

    def step_source(self) -> Path:
        """Where the server writes one line per step: vLLM's iteration log, stepscope's trace."""
        return self.log_dir / ("vllm.log" if self.name == "vllm" else "stepscope-trace.jsonl")

    def step_times(self, lo: int, hi: int) -> list[tuple[int, float]]:
        """(prompt tokens, seconds) of each step written between byte offsets lo and hi."""
        if not self.step_log:
            return []
        with self.step_source().open("rb") as f:
            f.seek(lo)
            text = f.read(hi - lo).decode(errors="replace")
        if self.name == "vllm":
            return [(int(m[1]), float(m[2]) / 1e3) for m in VLLM_ITERATION.finditer(text)]
        out = []
        for line in text.splitlines():
            if '"type": "step"' not in line and '"type":"step"' not in line:
                continue
            msg = json.loads(line)
            prompt = sum(i["end"] - i["start"] for i in msg["items"] if i["kind"] != "decode")
            out.append((prompt, msg["t1"] - msg["t0"]))
        return out

    def tree_cpu_s(self) -> float:
        """CPU seconds used so far by the server and its child processes (vLLM's engine core)."""
        return sum(proc_cpu_s(p) for p in descendants(self.proc.pid))


VLLM_ITERATION = re.compile(
    r"Iteration\(\d+\): \d+ context requests, (\d+) context tokens, .*?"
    r"iteration elapsed time: ([\d.]+) ms"
)


def descendants(pid: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # ended meanwhile
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(server: Server, ps: list[list[int]], args: argparse.Namespace) -> Run:
    """One run against `server`, with what else loaded the machine meanwhile: the CPU that
    neither the server nor this client used, in cores, and the 1-minute load average after."""
    src = server.step_source()
    src.touch()
    lo, busy0, mine0 = src.stat().st_size, machine_busy_s(), server.tree_cpu_s()
    client0 = sum(os.times()[:2])
    run = asyncio.run(load(server.url, server.model, ps, args.output_len, args.in_flight,
                           server.name))  # fmt: skip
    time.sleep(0.5)  # the last steps' log lines
    others = (machine_busy_s() - busy0) - (server.tree_cpu_s() - mine0)
    others -= sum(os.times()[:2]) - client0
    run.other_cores = max(0.0, others) / run.wall_s
    run.loadavg = os.getloadavg()[0]
    run.steps = server.step_times(lo, src.stat().st_size)
    return run


def summary(r: Run) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    prompt = [t for n, t in r.steps if n > 0]
    decode = [t for n, t in r.steps if n == 0]
    return (f"| {r.server} | {r.tok_s:.1f} | {ms(percentile(r.ttft, 50))} | "
            f"{ms(percentile(r.itl, 50))} | {ms(percentile(r.itl, 99))} | "
            f"{ms(percentile(decode, 50))} | {len(prompt)}: {ms(percentile(prompt, 50))} / "
            f"{ms(max(prompt, default=None))} | {r.other_cores:.2f} | {r.loadavg:.1f} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.vs_vllm",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--policy", default="mixed", help="stepscope's scheduling policy")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads, both servers")
    p.add_argument("--port", type=int, default=18090, help="vLLM's; stepscope's is the next")
    p.add_argument("--vllm-venv", default=DEFAULT_VENV, help="vLLM's venv (made if missing)")
    p.add_argument("--only", choices=("vllm", "stepscope"), default=None)
    p.add_argument(
        "--same-prompts",
        action="store_true",
        help="every run sends run 1's prompts (from run 2 on, prefix-cache hits)",
    )
    p.add_argument(
        "--step-log",
        action="store_true",
        help="log every step: vLLM's --enable-logging-iteration-details, stepscope's --trace "
        "(which records every token message too, at some CPU cost); adds step times to the table",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the servers' logs (vLLM's iteration log, stepscope's trace) here",
    )
    args = p.parse_args()
    from engine.models.loader import resolve

    model_dir = resolve("smollm2", progress=False).path
    names = [n for n in ("vllm", "stepscope") if args.only in (None, n)]
    # run i's prompts; the warm-up's are their own (no prefix-cache hit from it)
    warm = prompts(model_dir, 1, seed=1000)
    loads = [prompts(model_dir, args.requests, seed=0 if args.same_prompts else i)
             for i in range(args.runs)]  # fmt: skip
    results: dict[str, list[Run]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        servers: list[Server] = []
        try:
            for name in names:  # both up, idle while the other is measured
                servers.append(start(name, args, model_dir, log_dir))
                s = servers[-1]
                asyncio.run(load(s.url, s.model, warm, 4, 1, name))
            for i in range(args.runs):  # interleaved: vLLM run i, stepscope run i, ...
                for s in servers:
                    results[s.name].append(measure(s, loads[i], args))
                    print(summary(results[s.name][-1]), flush=True)
        finally:
            for s in servers:
                s.proc.terminate()
            for s in servers:
                s.proc.wait(timeout=60)
    print(f"\nSmolLM2 float32, {args.requests} streamed requests, {args.in_flight} in flight, "
          f"{args.output_len} tokens each, budget {args.budget}, {args.threads} threads; "
          f"{'the same' if args.same_prompts else 'new'} prompts each run")  # fmt: skip
    print(
        "| server | output tok/s | TTFT p50 | ITL p50 | ITL p99 | decode step p50 | "
        "prompt steps: n, p50 / max | other load (cores) | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i in range(args.runs):
        for runs in results.values():
            print(summary(runs[i]))
    print("\nthe 12 longest inter-token gaps of each run (ms; ITL p99 is about the 8th of them):")
    for i in range(args.runs):
        for name, runs in results.items():
            top = sorted(runs[i].itl, reverse=True)[:12]
            print(f"run {i + 1} {name}: " + " ".join(f"{t * 1e3:.0f}" for t in top))
    if len(results) == 2:
        v, s = results["vllm"], results["stepscope"]
        same = total = 0
        for i, (a, b) in enumerate(zip(v, s, strict=True)):
            p99 = (percentile(b.itl, 99) or 0) / (percentile(a.itl, 99) or 1)
            print(f"run {i + 1}: stepscope / vLLM output tok/s {b.tok_s / a.tok_s:.2f}, "
                  f"ITL p99 {p99:.2f}")  # fmt: skip
            same += sum(x == y for x, y in zip(a.texts, b.texts, strict=True))
            total += len(a.texts)
        print(f"greedy completions identical: {same} of {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
