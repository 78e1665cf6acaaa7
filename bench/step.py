"""What does a decode step cost the engine itself? Decode steps at a fixed batch: the mean step
time and the Python calls per step. On a tiny model the step is mostly the engine's own CPU work
(scheduling, pages, inputs, sampling, detokenizing, records).

    python -m bench.step --model assets/tiny-llama --load-format dummy --batch 64
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from bench.common import table
from engine.llm import LLM
from instrumentation.errors import EngineError
from instrumentation.sampling import SamplingParams


def run(args: argparse.Namespace) -> None:
    llm = LLM(
        args.model,
        device=args.device,
        load_format=args.load_format,
        cache_type="naive",
        max_running_req=args.batch,
        progress=False,
    )
    budget = args.warm + args.steps + args.profiled + 16  # every request decodes to the end
    for i in range(args.batch):
        llm.submit([5 + i, 6, 7, 8] * 8, SamplingParams(max_tokens=budget, ignore_eos=True))
    while llm.scheduler.waiting:
        llm.step()
    for _ in range(args.warm):
        llm.step()
    t = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    ms = (time.perf_counter() - t) / args.steps * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profiled):
        llm.step()
    prof.disable()
    calls = pstats.Stats(prof).total_calls / args.profiled  # type: ignore[attr-defined]
    print(
        f"\ndecode steps at batch {args.batch}; model {llm.info.model} ({args.load_format}), "
        f"{llm.info.device}\n"
    )
    print(
        table(
            [f"ms / step (mean of {args.steps})", "Python calls / step"],
            [[ms, f"{calls:,.0f}"]],
        )
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    ap.add_argument("--batch", type=int, default=64, help="requests decoding in every step")
    ap.add_argument("--warm", type=int, default=10, help="decode steps before the timing")
    ap.add_argument("--steps", type=int, default=100, help="decode steps timed")
    ap.add_argument("--profiled", type=int, default=50, help="decode steps under cProfile")
    args = ap.parse_args(argv)
    for name in ("batch", "steps", "profiled"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    try:
        run(args)
    except EngineError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
