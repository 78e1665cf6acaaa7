"""Benchmarks that print tables; each compares against its peer in the same run.

    python -m engine.bench                      # throughput: 16 mixed-length prompts, engine vs HF generate
    python -m engine.bench --workload stall     # chats decoding when a long prompt arrives, both policies
    python -m engine.bench --workload step --model assets/tiny-llama --load-format dummy
                                                # per-step engine overhead: decode steps at --batch
    python -m engine.bench --workload sweep --budgets 32,128,512,2048 \
        --policies prefill_first,mixed --out DIR [--trace-file CSV --rate R --duration S]
                                                # one open-loop workload per (policy, budget):
                                                # DIR/<policy>-<budget>.jsonl, summary.csv,
                                                # tradeoff.html (engine.workload, instrumentation.sweep)

Numbers and the commands that made them are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import check_policy
from engine.llm import LLM
from engine.workload import AZURE_CONV, Arrival, Scaling, describe, poisson, read_trace, replay
from instrumentation.errors import EngineError
from instrumentation.fold import Fold
from instrumentation.metrics import gaps, percentile
from instrumentation.protocol import POLICY_NAMES
from instrumentation.records import EngineEvent
from instrumentation.sampling import SamplingParams

TEXT = (
    "The harbour master kept a ledger of every boat that left at dawn and every boat that came "
    "back at dusk, and in the margins he wrote what the sea had been like that day. "
)


def _prompt_of(llm: LLM, n_tokens: int, salt: int) -> list[int]:
    """A natural-text prompt of exactly n_tokens; `salt` makes it differ from its siblings."""
    ids = llm.tokenizer.encode(f"Story {salt}. " + TEXT * (n_tokens // 20 + 2))
    return ids[:n_tokens]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


# -- throughput ------------------------------------------------------------------------------
def throughput(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(
        args.model,
        device=args.device,
        max_extend_tokens=args.budget,
        cache_type="naive",
        progress=False,
    )
    rng = random.Random(0)
    lengths = [rng.choice([16, 32, 64, 128, 256, 512]) for _ in range(args.num_prompts)]
    prompts = [_prompt_of(llm, n, i) for i, n in enumerate(lengths)]
    n_out = args.max_tokens
    params = SamplingParams(max_tokens=n_out, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up

    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    t_engine = time.perf_counter() - t
    assert all(len(o["token_ids"]) == n_out for o in outs)

    hf = (
        AutoModelForCausalLM.from_pretrained(str(llm_path(args.model)), dtype=llm.dtype)
        .to(llm.device)
        .eval()
    )
    width = max(lengths)
    pad = 0
    batch = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        batch[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    batch, mask = batch.to(llm.device), mask.to(llm.device)
    with torch.no_grad():
        hf.generate(
            batch[:1, -8:],
            attention_mask=mask[:1, -8:],
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=pad,
        )
        t = time.perf_counter()
        hf.generate(
            batch,
            attention_mask=mask,
            max_new_tokens=n_out,
            min_new_tokens=n_out,
            do_sample=False,
            pad_token_id=pad,
        )
        t_hf = time.perf_counter() - t

    total = n_out * len(prompts)
    print(
        f"\n{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens (sum {sum(lengths)}), "
        f"{n_out} output tokens each; model {llm.info.model}, {llm.info.device}, {llm.info.dtype}, "
        f"torch threads {torch.get_num_threads()}, engine budget {args.budget}\n"
    )
    rows = [
        ["stepscope engine (continuous batching)", t_engine, total / t_engine],
        ["HF generate (one padded batch)", t_hf, total / t_hf],
    ]
    print(_table(["system", "wall s", "output tok/s"], rows))
    print(f"\nengine / HF throughput ratio: {t_hf / t_engine:.2f}x")


def llm_path(model: str) -> Any:
    from engine.models.loader import resolve

    return resolve(model, progress=False).path


# -- the stall -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StallResult:
    policy: str
    budget: int
    long_ttft: float
    itl_p50: float
    itl_p99: float
    itl_max: float
    worst_stall: float | None  # the chats' longest stall (instrumentation.metrics); None: none
    out_tok_s: float
    steps: int


def stall_run(llm: LLM, policy: str, budget: int, args: argparse.Namespace) -> StallResult:
    """The chats' figures as the shared fold (the page, the sweep, /metrics) computes them."""
    llm.set_config(max_extend_tokens=budget, policy=policy)
    fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62)

    def hook(ev: EngineEvent) -> None:
        fold.apply(ev.to_dict())

    llm.add_event_hook(hook)
    try:
        chats = [
            llm.submit(
                f"Chat {i}: tell me about the sea and the boats.",
                SamplingParams(max_tokens=args.chat_tokens, ignore_eos=True),
            )
            for i in range(args.num_chats)
        ]
        steps = 0
        # the chats are decoding when the long prompt arrives
        while min(_output_len(fold, u) for u in chats) < 4:
            llm.step()
            steps += 1
        long_prompt = _prompt_of(llm, args.long_tokens, budget)
        t_start = llm.now()
        long_uid = llm.submit(long_prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        while llm.has_work():
            llm.step()
            steps += 1
        wall = llm.now() - t_start
    finally:
        llm.remove_event_hook(hook)
    recs = [fold.get(u) for u in chats]
    itl = [g for rec in recs if rec is not None for g in gaps(rec.token_times)]
    stalls = [r.max_stall for r in recs if r is not None and r.max_stall is not None]
    out_tokens = sum(len(r.token_times) for r in recs if r is not None) + 16
    long = fold.get(long_uid)
    long_metrics = long.metrics() if long is not None else None
    return StallResult(
        policy,
        budget,
        (long_metrics or {}).get("time_to_first_token_seconds") or 0.0,
        percentile(itl, 50) or 0.0,
        percentile(itl, 99) or 0.0,
        max(itl),
        max(stalls, default=None),
        out_tokens / wall,
        steps,
    )


def _output_len(fold: Fold, uid: int) -> int:
    rec = fold.get(uid)
    return 0 if rec is None else rec.output_len


def stall(args: argparse.Namespace) -> None:
    llm = LLM(
        args.model,
        device=args.device,
        cache_type="naive",  # every run computes the long prompt in full
        max_running_req=max(32, args.num_chats + 1),
        progress=False,
    )
    llm.generate(["warm up"], SamplingParams(max_tokens=2, ignore_eos=True))
    results = [stall_run(llm, p, b, args) for b in args.budgets for p in POLICY_NAMES]
    llm.check_integrity()
    print(
        f"\n{args.num_chats} chats decoding ({args.chat_tokens} tokens each) when a "
        f"{args.long_tokens}-token prompt arrives; model {llm.info.model}, {llm.info.device}, "
        f"{llm.info.dtype}\n"
    )
    rows = [
        [r.policy, r.budget, r.long_ttft, r.itl_p50, r.itl_p99, r.itl_max,
         "none" if r.worst_stall is None else r.worst_stall, r.out_tok_s, r.steps]
        for r in results
    ]  # fmt: skip
    headers = ["policy", "budget", "long TTFT s", "chat ITL p50 s", "p99 s", "max s",
               "worst stall s", "out tok/s", "steps"]  # fmt: skip
    print(_table(headers, rows))
    print("\nchats' max ITL, prefill_first / mixed (a stall is a gap in which steps ran without "
          "the chat: mixed has none):")  # fmt: skip
    for b in args.budgets:
        pf = next(r for r in results if r.budget == b and r.policy == "prefill_first")
        mx = next(r for r in results if r.budget == b and r.policy == "mixed")
        print(
            f"  budget {b}: {pf.itl_max:.3f} s / {mx.itl_max:.3f} s = {pf.itl_max / mx.itl_max:.1f}x"
        )


# -- per-step overhead -----------------------------------------------------------------------
def step_overhead(args: argparse.Namespace) -> None:
    """Decode steps at a fixed batch; on a tiny model the step time is mostly the engine's own
    CPU work (scheduling, pages, inputs, sampling, detokenizing, records)."""
    import cProfile
    import pstats

    llm = LLM(
        args.model,
        device=args.device,
        load_format=args.load_format,
        cache_type="naive",
        max_running_req=args.batch,
        progress=False,
    )
    for i in range(args.batch):
        llm.submit([5 + i, 6, 7, 8] * 8, SamplingParams(max_tokens=400, ignore_eos=True))
    while llm.scheduler.waiting:
        llm.step()
    for _ in range(10):
        llm.step()
    n = 100
    t = time.perf_counter()
    for _ in range(n):
        llm.step()
    ms = (time.perf_counter() - t) / n * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        llm.step()
    prof.disable()
    calls = pstats.Stats(prof).total_calls / 50  # type: ignore[attr-defined]
    print(
        f"\ndecode steps at batch {args.batch}; model {llm.info.model} ({args.load_format}), {llm.info.device}\n"
    )
    print(_table(["ms / step (mean of 100)", "Python calls / step"], [[ms, f"{calls:,.0f}"]]))


# -- the sweep -------------------------------------------------------------------------------
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

    if not args.out:
        raise EngineError("--workload sweep needs --out DIR")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = sorted(set(args.budgets))
    policies = list(dict.fromkeys(_flat(args.policies, str)))
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


def _flat(values: Sequence[str], kind: type = int) -> list[Any]:
    """`--budgets 32,128 512` → [32, 128, 512]: commas and spaces both separate."""
    return [kind(v) for value in values for v in str(value).split(",") if v]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workload", choices=["throughput", "stall", "step", "sweep"], default="throughput"
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", type=int, default=512, help="max_extend_tokens (throughput)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--budgets", nargs="+", default=["32,128,512"], help="(stall, sweep) e.g. 32,128,512,2048"
    )
    ap.add_argument("--num-chats", type=int, default=8)
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64, help="(step)")
    ap.add_argument(
        "--load-format", choices=["auto", "dummy"], default="auto", help="(step, sweep)"
    )
    sw = ap.add_argument_group("sweep (engine.workload: arrivals and lengths, and their scaling)")
    sw.add_argument("--policies", nargs="+", default=["prefill_first,mixed"])
    sw.add_argument("--out", metavar="DIR", help="where the traces, summary.csv and figure go")
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
    sw.add_argument("--max-running-req", type=int, default=32)
    sw.add_argument("--seed", type=int, default=0, help="arrivals, lengths and prompt tokens")
    sw.add_argument(
        "--no-png", dest="png", action="store_false", help="skip tradeoff.png (needs a browser)"
    )
    args = ap.parse_args(argv)
    args.budgets = _flat(args.budgets)
    try:
        {"throughput": throughput, "stall": stall, "step": step_overhead, "sweep": sweep}[
            args.workload
        ](args)
    except EngineError as e:  # a bad budget, model path, ...: say so, without a traceback
        ap.error(str(e))


if __name__ == "__main__":
    main()
