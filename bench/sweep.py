"""Which budget and policy suit a workload? One open-loop workload replayed under each
(policy, budget): a trace per run, a summary table and the trade-off figure.

    python -m bench.sweep --budgets 32,128,512,2048 --policies prefill_first,mixed --out DIR \
        [--trace-file CSV --rate R --duration S]

Requests arrive as the Azure conversation trace's lengths at Poisson `--rate` (or as a trace
file's arrivals and lengths, its clock rescaled to `--rate`), scaled and clamped
(engine.workload). Each run is written as DIR/<policy>-<budget>.jsonl in the server's `--trace`
format, then DIR/summary.csv and DIR/tradeoff.html (instrumentation.sweep; PNG too where a
browser is). `python -m instrumentation.sweep DIR` redraws them from the traces alone, and the
page's "Open sweep folder" draws and replays them.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import flat
from engine.config import check_policy
from engine.llm import LLM
from engine.workload import AZURE_CONV, Arrival, Scaling, describe, poisson, read_trace, replay
from instrumentation.errors import EngineError
from instrumentation.sampling import SamplingParams


def sweep_workload(args: argparse.Namespace, max_seq_len: int) -> list[Arrival]:
    """The sweep's requests: the trace file's arrivals and lengths, or Poisson arrivals at
    `--rate` with lengths drawn from the Azure conversation trace; scaled (engine.workload)."""
    scaling = Scaling(args.length_scale, args.max_prompt, args.max_output, max_seq_len)
    if args.trace_file:
        rows = read_trace(args.trace_file)
        return replay(rows, scaling, args.rate, args.duration, args.trace_start, args.max_requests)
    arrivals = poisson(args.rate or 1.0, args.duration, read_trace(AZURE_CONV), scaling, args.seed)
    return arrivals[: args.max_requests] if args.max_requests else arrivals


def sweep_prompts(arrivals: Sequence[Arrival], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, one distinct prompt per request: as the Azure traces say, only the
    lengths matter for the timings (and no two prompts share a prefix)."""
    rng = random.Random(seed)
    lo = min(1000, vocab_size // 2)  # clear of the special tokens at the start of vocabularies
    return [[rng.randrange(lo, vocab_size) for _ in range(a.prompt_len)] for a in arrivals]


def run_arrivals(llm: LLM, arrivals: Sequence[Arrival], prompts: Sequence[list[int]]) -> float:
    """Submit each request when its time comes (open loop) and step until all have finished;
    returns the wall seconds. A request is queued at the step boundary after its arrival, as
    a server queues what its socket received while a step ran."""
    start = time.perf_counter()
    i, n = 0, len(arrivals)
    while i < n or llm.has_work():
        now = time.perf_counter() - start
        while i < n and arrivals[i].t <= now:
            params = SamplingParams(max_tokens=arrivals[i].output_len, ignore_eos=True)
            llm.submit(prompts[i], params)
            i += 1
        if llm.has_work():
            llm.step()
        elif i < n:
            time.sleep(min(0.05, max(0.0, arrivals[i].t - now)))
    return time.perf_counter() - start


def sweep(args: argparse.Namespace) -> None:
    from instrumentation.sweep import (
        RunTrace,
        format_table,
        run_file,
        summary_row,
        write_figure,
        write_summary,
    )
    from instrumentation.trace import read_jsonl

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = sorted(set(args.budgets))
    policies = list(dict.fromkeys(flat(args.policies, str)))
    for policy in policies:
        check_policy(policy)
    llm = LLM(
        args.model,
        device=args.device,
        load_format=args.load_format,
        cache_type="naive",  # every run computes every prompt in full: no cross-run cache hits
        max_running_req=args.max_running_req,
        max_extend_tokens=budgets[0],
        progress=False,
    )
    arrivals = sweep_workload(args, llm.max_seq_len)
    if not arrivals:
        raise EngineError("the workload has no requests: raise --rate or --duration")
    prompts = sweep_prompts(arrivals, llm.model_config.vocab_size, args.seed)
    source = args.trace_file or f"Poisson {args.rate or 1.0}/s, lengths from {AZURE_CONV.name}"
    print(
        f"sweep: {describe(arrivals)}\n  from {source}, lengths x{args.length_scale}; "
        f"model {llm.info.model} ({args.load_format}), {llm.info.device}, {llm.info.dtype}",
        flush=True,
    )
    # warm-up (not recorded): a long prompt in chunks and some decodes, under every budget
    for b in budgets:
        llm.set_config(max_extend_tokens=b)
        llm.generate(
            [prompts[0][: min(len(prompts[0]), 2 * b)]],
            SamplingParams(max_tokens=4, ignore_eos=True),
        )
    rows = []
    for budget in budgets:  # both policies back to back: a noisy machine hits them alike
        for policy in policies:
            llm.set_config(max_extend_tokens=budget, policy=policy)
            path = out / run_file(policy, budget)
            trace = RunTrace(path, llm.info.to_dict(), llm.config_dict(), llm.now())
            llm.add_event_hook(trace)
            try:
                wall = run_arrivals(llm, arrivals, prompts)
            finally:
                llm.remove_event_hook(trace)
                trace.close()
            row = summary_row(policy, budget, read_jsonl(path))
            rows.append(row)
            print(
                f"  {policy:>13} budget {budget:>5}: {wall:6.1f} s, TTFT p50 "
                f"{row.ttft_p50_s or 0:.3f} s, ITL p99 {row.itl_p99_s or 0:.3f} s -> {path}",
                flush=True,
            )
    llm.check_integrity()
    write_summary(out / "summary.csv", rows)
    title = f"{llm.info.model} on {llm.info.device}: {len(arrivals)} requests, {source}"
    try:
        figures = write_figure(out, rows, title, png=args.png)
    except ImportError:  # plotly is in the `app` extra; the traces and summary are written
        figures = []
        print(f"plotly is not installed: no figure; `python -m instrumentation.sweep {out}` "
              "where it is draws it from the traces")  # fmt: skip
    print("\n" + format_table(rows))
    print("\nwrote " + ", ".join(str(p) for p in [out / "summary.csv", *figures]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    ap.add_argument("--budgets", nargs="+", default=["32,128,512"], help="e.g. 32,128,512,2048")
    ap.add_argument("--policies", nargs="+", default=["prefill_first,mixed"])
    ap.add_argument(
        "--out", metavar="DIR", required=True, help="where the traces, summary.csv and figure go"
    )
    sw = ap.add_argument_group(
        "workload (engine.workload: arrivals and lengths, and their scaling)"
    )
    sw.add_argument("--trace-file", metavar="CSV", help="replay an Azure LLM trace's arrivals")
    sw.add_argument(
        "--rate", type=float, help="requests/s: Poisson rate, or the trace's clock rescaled to it"
    )
    sw.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    sw.add_argument("--trace-start", type=int, default=0, help="first trace row replayed")
    sw.add_argument("--max-requests", type=int, help="at most this many requests")
    sw.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply trace prompt/output lengths"
    )
    sw.add_argument("--max-prompt", type=int, help="clamp scaled prompt lengths")
    sw.add_argument("--max-output", type=int, help="clamp scaled output lengths")
    sw.add_argument("--seed", type=int, default=0, help="arrivals, lengths and prompt tokens")
    ap.add_argument("--max-running-req", type=int, default=32)
    ap.add_argument(
        "--no-png", dest="png", action="store_false", help="skip tradeoff.png (needs a browser)"
    )
    args = ap.parse_args(argv)
    args.budgets = flat(args.budgets)
    try:
        sweep(args)
    except EngineError as e:  # a bad budget, model path, ...: say so, without a traceback
        ap.error(str(e))


if __name__ == "__main__":
    main()
