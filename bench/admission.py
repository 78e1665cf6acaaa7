"""Which admission suits a workload? Reserve against optimistic admission, side by side in one
run.

    python -m bench.admission                        # CPU: SmolLM2-135M, a small pool
    python -m bench.admission --device cuda --model assets/qwen3-0.6b \
        --load-format dummy --num-requests 256 --max-tokens 1024 --prompt-len 256 \
        --pool-tokens 65536 --max-running-req 256 --budget 2048

A burst of requests, each with a generous `max_tokens` cap and its own real length: it stops when
it has that many tokens, as a request with a stop string does (the engine cannot know it in
advance; the bench aborts it then, as the OpenAI API does on a stop string). Three shapes of
real length, as fractions of the cap:

- `short`: 5-50% of the cap (chat answers under a generous cap): reserve promises the pool to
  outputs that never come;
- `mixed`: 5-100%;
- `full`: every request runs to its cap (`ignore_eos` benchmarks): the estimate is wrong by the
  most, and optimistic admission thrashes.

For each shape the engine runs the same requests under `reserve` then `optimistic` (prefix cache
flushed, `new_token_ratio` reset between runs) and the fold of its event stream gives the table:
output tokens per second, TTFT and ITL p50/p99, retractions and recomputed tokens.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from engine.llm import LLM
from instrumentation.fold import Fold, Summary
from instrumentation.records import EngineEvent, StepRecord, TokenEvent
from instrumentation.sampling import SamplingParams

SHAPES = {"short": (0.05, 0.5), "mixed": (0.05, 1.0), "full": (1.0, 1.0)}


@dataclass(frozen=True, slots=True)
class Row:
    shape: str
    admission: str
    wall_s: float
    summary: Summary
    max_used: int  # pages held by requests, at most, over the run
    total: int


def _workload(args: argparse.Namespace, shape: str, vocab: int) -> tuple[list, list[int]]:
    rng = random.Random(args.seed)
    lo, hi = SHAPES[shape]
    prompts, lengths = [], []
    for _ in range(args.num_requests):
        n = rng.randrange(args.prompt_len // 2, args.prompt_len + 1)
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])
        lengths.append(max(1, round(args.max_tokens * rng.uniform(lo, hi))))
    return prompts, lengths


def run(llm: LLM, prompts: list, lengths: list[int], cap: int, admission: str) -> Row:
    """One burst to completion under `admission`; a request stops at its own length."""
    llm.set_config(admission=admission)
    llm.flush_cache()
    ratio = llm.scheduler.ratio
    ratio.value = ratio.init  # each run starts from the same estimate
    fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62)
    produced: dict[int, int] = {}
    stop_at: dict[int, int] = {}
    peak = [0]

    def hook(ev: EngineEvent) -> None:
        fold.apply(ev.to_dict())
        if isinstance(ev, TokenEvent):
            n = produced[ev.uid] = produced.get(ev.uid, 0) + 1
            if n == stop_at.get(ev.uid):
                llm.abort(ev.uid)  # its stop condition: applied at the next step
        elif isinstance(ev, StepRecord):
            peak[0] = max(peak[0], ev.kv.used)

    llm.add_event_hook(hook)
    t = time.perf_counter()
    try:
        params = SamplingParams(max_tokens=cap, ignore_eos=True)
        for ids, n in zip(prompts, lengths, strict=True):
            uid = llm.submit(ids, params)
            if n < cap:
                stop_at[uid] = n
        while llm.has_work():
            llm.step()
    finally:
        llm.remove_event_hook(hook)
    wall = time.perf_counter() - t
    llm.check_integrity()
    return Row("", admission, wall, fold.summary(), peak[0], llm.num_pages)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def table(rows: list[Row]) -> str:
    head = ("| shape | admission | wall s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
            "| retractions | recomputed tokens | peak KV used |")  # fmt: skip
    out = [head, "|" + "---|" * 9]
    for r in rows:
        s = r.summary
        out.append(
            f"| {r.shape} | {r.admission} | {r.wall_s:.1f} | {s.output_tok_s or 0:.1f} | "
            f"{_ms(s.ttft_p50_s)} / {_ms(s.ttft_p99_s)} | {_ms(s.itl_p50_s)} / {_ms(s.itl_p99_s)} "
            f"| {s.retractions} | {s.recomputed_tokens} | {r.max_used / r.total:.0%} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.admission",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--num-requests", "--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompts of half this to this")
    ap.add_argument(
        "--max-tokens", "--max-output", type=int, default=128, help="every request's cap"
    )
    ap.add_argument("--pool-tokens", type=int, default=1024, help="KV pool size in tokens")
    ap.add_argument("--num-pages", type=int, help="KV pool size in pages (over --pool-tokens)")
    ap.add_argument("--max-running-req", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256, help="max_extend_tokens")
    ap.add_argument("--policy", default="mixed", choices=["prefill_first", "mixed"])
    ap.add_argument("--shapes", default="short,mixed,full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    page = 16 if args.device == "cuda" else 1
    llm = LLM(
        args.model, device=args.device, load_format=args.load_format, page_size=page,
        num_pages=args.num_pages or args.pool_tokens // page, max_running_req=args.max_running_req,
        max_seq_len=args.prompt_len + args.max_tokens, max_extend_tokens=args.budget,
        policy=args.policy, progress=False,
    )  # fmt: skip
    print(
        f"{llm.info.model} on {llm.info.device} ({llm.info.dtype}), pool {llm.num_pages} pages "
        f"x {llm.page_size}, {args.num_requests} requests of {args.prompt_len // 2}-"
        f"{args.prompt_len} prompt tokens, max_tokens {args.max_tokens}, budget {args.budget}, "
        f"{args.policy}",
        flush=True,
    )
    warm, _ = _workload(args, "short", llm.model_config.vocab_size)
    llm.generate(warm[:4], SamplingParams(max_tokens=8, ignore_eos=True))  # not recorded
    rows = []
    for shape in args.shapes.split(","):
        prompts, lengths = _workload(args, shape, llm.model_config.vocab_size)
        for admission in ("reserve", "optimistic"):  # back to back: a noisy machine hits both
            r = run(llm, prompts, lengths, args.max_tokens, admission)
            rows.append(Row(shape, admission, r.wall_s, r.summary, r.max_used, r.total))
            print(f"  {shape:>5} {admission:>10}: {r.wall_s:.1f} s", flush=True)
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
