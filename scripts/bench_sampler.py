"""The decode step's cost of sampling: greedy against temperature sampling, through `LLM`.

    python scripts/bench_sampler.py --model tiny --streams 16
    # the H200 (issue 27's guidellm load: OpenAI's default temperature 1, Qwen3's top-k / top-p):
    python scripts/bench_sampler.py --model .whl/qwen3 --load-format dummy --device cuda

Each variant runs the same N requests (random prompts, ignore_eos) and reports the median
period between decode steps that held all N. `--root DIR` imports the engine from another
checkout (before and after, one process each, same machine).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.6, top-k 20, top-p 0.95": {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
    "the same, seeded": {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 1},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--root", default=None, help="import the engine from this checkout")
    args = p.parse_args()
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from engine import LLM
    from instrumentation.sampling import SamplingParams

    # after the engine is imported from `root`: bench_http puts this checkout first on the path
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from scripts.bench_http import decode_period

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from engine.checks.models import make_tiny
            from engine.models.loader import resolve

            model = str(make_tiny("llama", Path(tmp) / "tiny", resolve("smollm2").path))
        llm = LLM(model, load_format=args.load_format, device=args.device, policy="mixed",
                  max_extend_tokens=8192, max_running_req=args.streams, progress=False,
                  max_seq_len=args.prompt_len + args.output_len + 16)  # fmt: skip
        steps: list = []
        llm.add_step_hook(steps.append)
        rng = random.Random(0)
        vocab = llm.info.vocab_size
        ps = [[rng.randrange(100, vocab - 1) for _ in range(args.prompt_len)]
              for _ in range(args.streams)]  # fmt: skip
        llm.generate(ps[:2], SamplingParams(max_tokens=8, temperature=1.0))  # warm-up
        print(f"engine from {root}; {args.streams} requests, {args.prompt_len} + "
              f"{args.output_len} tokens, {args.device}\n")  # fmt: skip
        print("| sampling | decode step p50 |\n|---|---|")
        for name, fields in VARIANTS.items():
            steps.clear()
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **fields)
            llm.generate(ps, params)
            step = decode_period(steps, args.streams)
            print(f"| {name} | {step * 1e3:.2f} ms |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
