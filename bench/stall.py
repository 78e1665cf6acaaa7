"""How long do decoding chats stall when a long prompt arrives? Both policies at each budget.

    python -m bench.stall                               # SmolLM2 on CPU: 8 chats, 2,000 tokens
    python -m bench.stall --model assets/tiny-llama --load-format dummy --num-chats 4 \
        --chat-tokens 24 --long-tokens 256 --budgets 32,128
    python -m bench.stall --trace DIR                   # also record every run for the page

`--num-chats` chats decode (`--chat-tokens` each); once each has 4 tokens, a `--long-tokens`
prompt arrives. Per (policy, budget): the long prompt's TTFT, the chats' inter-token gaps
(p50, p99, max) and their worst stall (a gap in which steps ran without the chat), as the
shared fold (the page, the sweep, /metrics) computes them. With `--trace DIR` each run is also
written as DIR/<policy>-<budget>.jsonl with DIR/summary.csv: a sweep folder, which the page
draws as a trade-off and replays run by run ("Open sweep folder").
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import flat, prompt_of, table
from engine.config import check_policy
from engine.llm import LLM
from instrumentation.errors import EngineError
from instrumentation.fold import Fold
from instrumentation.metrics import gaps, percentile
from instrumentation.protocol import POLICY_NAMES
from instrumentation.records import EngineEvent
from instrumentation.sampling import SamplingParams


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


def stall_run(
    llm: LLM, policy: str, budget: int, args: argparse.Namespace, trace: Path | None = None
) -> StallResult:
    """The chats' figures as the shared fold computes them; `trace`: also write the run there."""
    from instrumentation.sweep import RunTrace

    llm.set_config(max_extend_tokens=budget, policy=policy)
    fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62)
    writer = (
        None if trace is None else RunTrace(trace, llm.info.to_dict(), llm.config_dict(), llm.now())
    )

    def hook(ev: EngineEvent) -> None:
        msg = ev.to_dict()
        fold.apply(msg)
        if writer is not None:
            writer(dict(msg))

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
        long_prompt = prompt_of(llm, args.long_tokens, budget)
        t_start = llm.now()
        long_uid = llm.submit(long_prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        while llm.has_work():
            llm.step()
            steps += 1
        wall = llm.now() - t_start
    finally:
        llm.remove_event_hook(hook)
        if writer is not None:
            writer.close()
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


def write_sweep_summary(folder: Path, policies: Sequence[str], budgets: Sequence[int]) -> Path:
    """summary.csv from the runs' traces alone, as a sweep folder has it."""
    from instrumentation.sweep import run_file, summary_row, write_summary
    from instrumentation.trace import read_jsonl

    rows = [
        summary_row(p, b, read_jsonl(folder / run_file(p, b))) for b in budgets for p in policies
    ]
    write_summary(folder / "summary.csv", rows)
    return folder / "summary.csv"


def run(args: argparse.Namespace) -> None:
    from instrumentation.sweep import run_file

    policies = list(dict.fromkeys(flat(args.policies, str)))
    for policy in policies:
        check_policy(policy)
    llm = LLM(
        args.model,
        device=args.device,
        load_format=args.load_format,
        cache_type="naive",  # every run computes the long prompt in full
        max_running_req=max(32, args.num_chats + 1),
        progress=False,
    )
    llm.generate(["warm up"], SamplingParams(max_tokens=2, ignore_eos=True))
    folder = None if args.trace is None else Path(args.trace)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    results = [
        stall_run(llm, p, b, args, None if folder is None else folder / run_file(p, b))
        for b in args.budgets
        for p in policies
    ]
    llm.check_integrity()
    print(
        f"\n{args.num_chats} chats decoding ({args.chat_tokens} tokens each) when a "
        f"{args.long_tokens}-token prompt arrives; model {llm.info.model} ({args.load_format}), "
        f"{llm.info.device}, {llm.info.dtype}\n"
    )
    rows = [
        [r.policy, r.budget, r.long_ttft, r.itl_p50, r.itl_p99, r.itl_max,
         "none" if r.worst_stall is None else r.worst_stall, r.out_tok_s, r.steps]
        for r in results
    ]  # fmt: skip
    headers = ["policy", "budget", "long TTFT s", "chat ITL p50 s", "p99 s", "max s",
               "worst stall s", "out tok/s", "steps"]  # fmt: skip
    print(table(headers, rows))
    if {"prefill_first", "mixed"} <= set(policies):
        print("\nchats' max ITL, prefill_first / mixed (a stall is a gap in which steps ran "
              "without the chat: mixed has none):")  # fmt: skip
        for b in args.budgets:
            pf = next(r for r in results if r.budget == b and r.policy == "prefill_first")
            mx = next(r for r in results if r.budget == b and r.policy == "mixed")
            ratio = pf.itl_max / mx.itl_max
            print(f"  budget {b}: {pf.itl_max:.3f} s / {mx.itl_max:.3f} s = {ratio:.1f}x")
    if folder is not None:
        summary = write_sweep_summary(folder, policies, args.budgets)
        print(f"\nwrote {len(results)} traces and {summary}: open {folder} in the page")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.stall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    ap.add_argument("--budgets", nargs="+", default=["32,128,512"], help="e.g. 32,128,512,2048")
    ap.add_argument("--policies", nargs="+", default=[",".join(POLICY_NAMES)])
    ap.add_argument("--num-chats", type=int, default=8)
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--trace", metavar="DIR", help="write each run's trace and summary.csv here")
    args = ap.parse_args(argv)
    args.budgets = flat(args.budgets)
    try:
        run(args)
    except EngineError as e:  # a bad budget, model path, ...: say so, without a traceback
        ap.error(str(e))


if __name__ == "__main__":
    main()
