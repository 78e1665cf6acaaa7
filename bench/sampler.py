"""What does sampling cost a decode step? Greedy against temperature sampling, through `LLM`.

    python -m bench.sampler --model tiny --streams 16
    # on a GPU, Qwen3-0.6B's shape with random weights (OpenAI's default temperature 1, and
    # Qwen3's recommended top-k / top-p):
    python -m bench.sampler --model assets/qwen3-0.6b --load-format dummy --device cuda

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
from typing import Any

from bench.common import decode_period, model_path, table

VARIANTS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.6, top-k 20, top-p 0.95": {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
    "the same, seeded": {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 1},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.sampler",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or a model directory")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--root", default=None, help="import the engine from this checkout")
    return p


def run(args: argparse.Namespace) -> list[list[Any]]:
    """The decode step p50 per sampling variant; prints the table and returns its rows."""
    if args.root:  # before the engine's first import: that checkout's engine is the one used
        sys.path.insert(0, str(Path(args.root).resolve()))
    from engine import LLM
    from instrumentation.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = model_path(args.model, Path(tmp))
        llm = LLM(model, load_format=args.load_format, device=args.device, policy="mixed",
                  max_extend_tokens=8192, max_running_req=args.streams, progress=False,
                  max_seq_len=args.prompt_len + args.output_len + 16)  # fmt: skip
        steps: list[Any] = []
        llm.add_step_hook(steps.append)
        rng = random.Random(0)
        vocab = llm.info.vocab_size
        ps = [[rng.randrange(100, vocab - 1) for _ in range(args.prompt_len)]
              for _ in range(args.streams)]  # fmt: skip
        llm.generate(ps[:2], SamplingParams(max_tokens=8, temperature=1.0))  # warm-up
        print(f"engine from {args.root or 'this checkout'}; {args.streams} requests, "
              f"{args.prompt_len} + {args.output_len} tokens, {args.device}\n")  # fmt: skip
        rows = []
        for name, fields in VARIANTS.items():
            steps.clear()
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **fields)
            llm.generate(ps, params)
            rows.append([name, decode_period(steps, args.streams) * 1e3])
    print(table(["sampling", "decode step p50 ms"], rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.streams < 1 or args.output_len < 2:
        p.error("--streams must be at least 1 and --output-len at least 2")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
