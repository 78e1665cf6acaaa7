"""The HTTP path against the engine alone: decode tok/s and ITL at 1, 16, 64 and 256 streams.

    python -m bench.http --model tiny --prompt-len 64 --output-len 64 --streams 1,16,64
    # on a GPU, Qwen3-0.6B's shape with random weights:
    python -m bench.http --model assets/qwen3-0.6b --load-format dummy --device cuda \
        --policy mixed --budget 8192 --prompt-len 512 --output-len 256 --streams 1,16,64,256

`--hot-path` times only the HTTP side's Python per token (router, streams, SSE bytes).

For each stream count N, the same N requests (random prompts of --prompt-len tokens, --output-len
tokens each, ignore_eos) run twice:

- **engine alone**: through `LLM` in this process. Its decode rate is N / the median step time
  of the decode steps that held all N requests.
- **through HTTP**: `python -m engine.server` in a subprocess, with N streamed `/v1/completions`
  from a stdlib asyncio client (raw sockets, server-sent events read as they come). Its decode
  rate counts the tokens the clients received while all N streams were decoding (from the last
  stream's first token to the first stream's last), over that window. ITL is the gap between
  one stream's consecutive token chunks as the client saw them.

The table gives both rates, their ratio, and the HTTP ITL p50 / p99 beside the engine step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import decode_period, model_path, table
from bench.sse import completion_events
from instrumentation.metrics import gaps, percentile

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    streams: int
    engine_step_s: float = 0.0
    engine_tok_s: float = 0.0
    http_tok_s: float = 0.0
    itl: list[float] = field(default_factory=list)
    engine_itl: list[float] = field(default_factory=list)
    steady_itl: list[float] = field(default_factory=list)  # HTTP, while every stream decodes
    engine_steady_itl: list[float] = field(default_factory=list)
    cores: dict[str, float] = field(default_factory=dict)  # server processes' CPU during the run


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(n)]


def engine_args(args: argparse.Namespace, model: str, running: int) -> dict[str, Any]:
    return dict(model=model, device=args.device, dtype=args.dtype, policy=args.policy,
                max_extend_tokens=args.budget, max_running_req=running,
                load_format=args.load_format, max_seq_len=args.prompt_len + args.output_len + 16)  # fmt: skip


def engine_itl(steps: list[Any]) -> tuple[list[float], list[float]]:
    """Every request's gaps between the completions of the steps that gave it a token (its
    prompt's last piece, then its decodes): the ITL the engine alone gives this load, to set
    beside the HTTP client's (instrumentation.metrics.gaps, the one definition of a gap); and
    the same gaps in the steady window only (`steady`)."""
    times: dict[int, list[float]] = {}
    for s in steps:
        for item in s.items:
            if item.samples:
                times.setdefault(item.uid, []).append(s.t1)
    runs = list(times.values())
    return [g for ts in runs for g in gaps(ts)], steady(runs)


def steady(runs: list[list[float]]) -> list[float]:
    """The gaps that lie wholly in the window where every stream decodes (from the last
    stream's first token to the first stream's last): no prompt joins the batch there, so
    these gaps are decode steps and their delivery alone."""
    runs = [t for t in runs if t]
    if not runs:
        return []
    start, end = max(t[0] for t in runs), min(t[-1] for t in runs)
    return [g for t in runs for g in gaps([x for x in t if start <= x <= end])]


def engine_alone(args: argparse.Namespace, model: str, counts: list[int], vocab: int) -> dict:
    """N / the median step of decode steps that held all N requests, per stream count."""
    from engine import LLM
    from instrumentation.sampling import SamplingParams

    llm = LLM(**engine_args(args, model, max(counts)), progress=False)
    steps: list[Any] = []
    llm.add_step_hook(steps.append)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts(1, 8, vocab, 99)[0]], SamplingParams(max_tokens=4))  # warm-up
    out = {}
    for n in counts:
        steps.clear()
        llm.generate(prompts(n, args.prompt_len, vocab, n), [params] * n)
        step = decode_period(steps, n)
        out[n] = (step, n / step, engine_itl(steps))
    if hasattr(llm, "close"):
        llm.close()
    return out


def start_server(
    args: argparse.Namespace,
    model: str,
    running: int,
    root: Path = ROOT,
    extra: tuple[str, ...] = (),
) -> tuple[Any, str]:
    """`python -m engine.server` from the checkout at `root` (this one, or --baseline-root)."""
    cmd = [sys.executable, "-m", "engine.server", "--model", model, "--port", "0",
           "--http-port", "0", "--device", args.device, "--policy", args.policy,
           "--max-extend-tokens", str(args.budget), "--max-running-req", str(running),
           "--max-seq-len", str(args.prompt_len + args.output_len + 16),
           "--load-format", args.load_format, "--max-waiting", str(max(1024, running))]  # fmt: skip
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += list(extra)
    path = os.environ.get("PYTHONPATH")  # the tree first: its `engine` is the one imported
    env = {**os.environ, "PYTHONPATH": str(root) if not path else f"{root}{os.pathsep}{path}"}
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    url = ""
    while not url:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the server exited before it was ready")
        if line.startswith("stepscope HTTP API at "):
            url = line.split(" at ", 1)[1].strip()
    return proc, url


async def stream_one(host: str, port: int, ids: list[int], n_out: int) -> list[float]:
    """One streamed completion; the receive time of each token chunk."""
    body = {"prompt": ids, "max_tokens": n_out, "stream": True, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    # a byte test, not a JSON parse: at 256 streams the client must not be the bottleneck
    return [t async for t, data in completion_events(host, port, body)
            if b'"text":' in data and b'"finish_reason":null' in data]  # fmt: skip


async def _streams(url: str, ps: list[list[int]], n_out: int) -> list[list[float]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return list(await asyncio.gather(*(stream_one(host, int(port), p, n_out) for p in ps)))


def _streams_in_process(job: tuple[str, list[list[int]], int]) -> list[list[float]]:
    return asyncio.run(_streams(*job))


class Clients:
    """Client processes, started fresh (spawn) and warmed before any stream: this process holds
    the engine-alone half's heap, whose garbage collections would add to the gaps measured."""

    def __init__(self, procs: int) -> None:
        import concurrent.futures
        import multiprocessing

        self.procs = procs
        ctx = multiprocessing.get_context("spawn")
        self.pool = concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx)
        list(self.pool.map(_ready, range(procs)))  # every worker up before the first stream

    def run(self, url: str, ps: list[list[int]], n_out: int) -> list[list[float]]:
        procs = max(1, min(self.procs, len(ps)))
        jobs = [(url, ps[k::procs], n_out) for k in range(procs)]
        return [r for part in self.pool.map(_streams_in_process, jobs) for r in part]

    def close(self) -> None:
        self.pool.shutdown()


def _ready(_: int) -> int:
    import gc

    gc.freeze()  # the imports stay out of every collection
    return os.getpid()


def http_run(
    url: str, n: int, args: argparse.Namespace, vocab: int, clients: Clients
) -> tuple[float, list[float], list[float]]:
    """N streams, read by the client processes (one asyncio loop each, N / procs streams):
    at 64 and more streams one loop's own turns add to the gaps it measures. Receive times are
    time.perf_counter's, the one monotonic clock of every process here."""
    runs = clients.run(url, prompts(n, args.prompt_len, vocab, n), args.output_len)
    start = max(t[0] for t in runs if t)  # every stream is decoding from here ...
    end = min(t[-1] for t in runs if t)  # ... to here
    in_window = sum(1 for t in runs for x in t if start < x <= end)
    itl = [g for t in runs for g in gaps(t)]
    return (in_window / (end - start) if end > start else float("nan")), itl, steady(runs)


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the server process (`engine`) and of each child (the
    API process), from /proc: which side is short of a core when streams grow."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for name, p in [("engine", pid), *((f"api {c}", int(c)) for c in children)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def hot_path(streams: int = 64, tokens: int = 200) -> float:
    """CPU seconds per token of the HTTP side alone (router, streams, choices, SSE bytes), fed
    one step's token per stream at a time as the publisher would: no engine, no sockets."""
    from types import SimpleNamespace

    from engine.server.openai.api import Choice, Generation, Router, Stream
    from engine.server.openai.app import Endpoints
    from engine.server.openai.response import ResponseHead
    from engine.server.openai.schema import parse_request

    async def run() -> float:
        loop = asyncio.get_running_loop()
        router = Router()
        api = SimpleNamespace(router=router, stop_request=None, abort=None)
        ep = Endpoints.__new__(Endpoints)
        ep.api = api  # type: ignore[assignment]
        req = parse_request({"prompt": "p", "stream": True, "max_tokens": tokens}, "completion")
        tasks = []
        for uid in range(streams):
            stream = Stream(loop)
            router.expect()  # as a submit does, until its reply names the uid
            router.register([uid], stream)
            gen = Generation(api, stream, [Choice(0, uid, [1], None, req)], 1)  # type: ignore[arg-type]
            head = ResponseHead(f"cmpl-{uid}", "m", "completion")

            async def drain(g: Generation = gen, h: ResponseHead = head) -> None:
                async for _ in ep._events(g, h, req):
                    pass

            tasks.append(asyncio.create_task(drain()))
        await asyncio.sleep(0)
        t0 = time.process_time()
        for _ in range(tokens):
            for uid in range(streams):
                router.sink({"type": "token", "uid": uid, "t": 1.0, "token_id": 5, "text": " w"})
            for _ in range(2):
                await asyncio.sleep(0)
        for uid in range(streams):
            router.sink({"type": "request", "uid": uid, "event": "finished", "t": 2.0,
                         "finish_reason": "length"})  # fmt: skip
        await asyncio.gather(*tasks)
        return (time.process_time() - t0) / (streams * tokens)

    return asyncio.run(run())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.http",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="'tiny', 'smollm2', a directory or a hub id")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--policy", default="mixed")
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--streams", default="1,16,64")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--baseline-root",
        default=None,
        help="also run the HTTP half against the server of the checkout in this directory "
        "(e.g. `git worktree add /tmp/base main`): before and after in one run",
    )
    p.add_argument(
        "--streams-per-client",
        type=int,
        default=1_000_000,
        help="streams one client process reads (default: all in one); at 64 streams and more "
        "a single asyncio client's own turns show in the ITL it measures",
    )
    p.add_argument(
        "--server-args",
        action="append",
        default=[],
        metavar="ARGS",
        help="also run the HTTP half with these extra server flags (repeatable), e.g. "
        "--server-args='--max-waiting 64': variants measured in one run",
    )
    p.add_argument(
        "--hot-path",
        action="store_true",
        help="only the HTTP side's CPU per token at 64 streams (no engine, no sockets)",
    )
    return p


def run(args: argparse.Namespace) -> list[tuple[str, list[Result]]]:
    """The engine alone, then the HTTP half through each server variant; prints the tables."""
    counts = [int(x) for x in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = model_path(args.model, Path(tmp))
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        from engine.models.loader import read_config, resolve

        vocab = read_config(resolve(model, progress=False).path)[0].vocab_size
        alone = engine_alone(args, model, counts, vocab)
        trees: list[tuple[str, Path, tuple[str, ...]]] = [("this tree", ROOT, ())]
        for extra in args.server_args:
            trees.append((f"this tree, {extra}", ROOT, tuple(shlex.split(extra))))
        if args.baseline_root:
            root = Path(args.baseline_root).resolve()
            trees.append(("baseline " + args.baseline_root, root, ()))
        tables = []
        procs = max(1, -(-max(counts) // args.streams_per_client))
        clients = Clients(procs)
        try:
            for label, root, flags in trees:
                tables.append((label, http_results(args, model, counts, vocab, alone, clients,
                                                   root, flags)))  # fmt: skip
        finally:
            clients.close()
    print(f"model {args.model} on {args.device}, prompt {args.prompt_len}, output {args.output_len}"
          f", policy {args.policy}, budget {args.budget}; client: {procs} process(es), at most "
          f"{min(args.streams_per_client, max(counts))} streams each")  # fmt: skip
    for label, results in tables:
        print(f"\nHTTP through {label}:")
        print_table(results)
    return tables


def http_results(
    args: argparse.Namespace,
    model: str,
    counts: list[int],
    vocab: int,
    alone: dict,
    clients: Clients,
    root: Path,
    flags: tuple[str, ...],
) -> list[Result]:
    """Each stream count through one server, beside the engine-alone figures."""
    proc, url = start_server(args, model, max(counts), root, flags)
    try:
        http_run(url, 1, args, vocab, clients)  # warm-up
        results = []
        for n in counts:
            before, t0 = cpu_seconds(proc.pid), time.monotonic()
            tok_s, itl, steady_itl = http_run(url, n, args, vocab, clients)
            span, after = time.monotonic() - t0, cpu_seconds(proc.pid)
            step, eng, (eng_itl, eng_steady) = alone[n]
            r = Result(n, step, eng, tok_s, itl, eng_itl, steady_itl, eng_steady)
            r.cores = {k: (after[k] - before.get(k, 0.0)) / span for k in after}
            results.append(r)
        return results
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def print_table(results: list[Result]) -> None:
    """The step is the median period of full decode steps. "engine ITL p99" is the same load's
    token gaps through `LLM` alone (prompt steps included), the fair yardstick for HTTP's p99;
    "steady" counts only the gaps while every stream decodes (no prompt joins): decode steps
    and their delivery, to set beside the step."""
    headers = ["streams", "engine step ms", "engine tok/s", "HTTP tok/s", "HTTP/engine",
               "ITL p50 ms", "ITL p99 ms", "p99 / step", "engine ITL p99 ms",
               "HTTP p99 / engine p99", "steady ITL p99 ms: HTTP / engine",
               "steady HTTP p99 / step"]  # fmt: skip
    print(table(headers, [result_row(r) for r in results]))
    for r in results:
        use = ", ".join(f"{k} {v:.2f}" for k, v in r.cores.items())
        print(f"cores busy at {r.streams} streams: {use}")


def result_row(r: Result) -> list[object]:
    p50, p99 = percentile(r.itl, 50) or 0.0, percentile(r.itl, 99) or 0.0
    e99 = percentile(r.engine_itl, 99) or float("nan")
    s99 = percentile(r.steady_itl, 99) or float("nan")
    se99 = percentile(r.engine_steady_itl, 99) or float("nan")
    return [r.streams, r.engine_step_s * 1e3, f"{r.engine_tok_s:,.0f}", f"{r.http_tok_s:,.0f}",
            r.http_tok_s / r.engine_tok_s, p50 * 1e3, p99 * 1e3, f"{p99 / r.engine_step_s:.1f}",
            e99 * 1e3, p99 / e99, f"{s99 * 1e3:.2f} / {se99 * 1e3:.2f}",
            f"{s99 / r.engine_step_s:.1f}"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.streams_per_client < 1:
        p.error("--streams-per-client must be at least 1")
    if args.hot_path:
        runs = sorted(hot_path() for _ in range(5))
        print(table(["HTTP side, 64 streams", "µs CPU per token (median of 5)"],
                    [["router, streams, SSE bytes", runs[2] * 1e6]]))  # fmt: skip
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
