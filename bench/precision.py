"""How far is bfloat16 from float32? bfloat16 against float32, with the usual bfloat16 residual
stream and with a float32 one (`residual_dtype="float32"`). Runs anywhere; on CPU, bfloat16
matmuls accumulate in float32 as tensor cores do.

    python -m bench.precision logits --model smollm2
    python -m bench.precision logits --model assets/qwen3-0.6b --dummy   # Qwen3-0.6B shape
    python -m bench.precision chunked --model smollm2 [--alone]

`logits`: per prompt, the relative error ||bf16 - fp32|| / ||fp32|| of the logits the first
token is sampled from. `chunked`: 32 chat prompts (150 to 900 tokens), greedy, 32 tokens, run
unchunked (budget 8192) and chunked (budget 64) in bfloat16: on how many prompts the tokens
agree, all prompts submitted together or (`--alone`) one at a time.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

from bench.common import notes_prompts
from checks.greedy import compare_greedy, last_logits, rel_err, trace_run
from engine import LLM, SamplingParams

RESIDUALS = {"bf16 residual": None, "float32 residual": "float32"}


def base(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=args.model,
        load_format="dummy" if args.dummy else "auto",
        max_seq_len=1200,
        num_pages=40000,
        max_running_req=32,
        cache_type="naive",
        progress=False,
    )


def engines(args: argparse.Namespace) -> tuple[LLM, dict[str, LLM]]:
    """A float32 reference and one bf16 engine per residual stream, all on the same weights."""
    kw = base(args)
    bf16 = {name: LLM(dtype="bfloat16", residual_dtype=r, **kw) for name, r in RESIDUALS.items()}
    weights = next(iter(bf16.values())).model.state_dict()
    for llm in bf16.values():
        llm.model.load_state_dict(weights)
    ref = LLM(dtype="float32", **kw)
    ref.model.load_state_dict({k: v.float() for k, v in weights.items()})
    return ref, bf16


def logits(args: argparse.Namespace) -> None:
    ref, bf16 = engines(args)
    rng = random.Random(0)
    lengths = [16, 40, 100, 200, 300, 450]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]
    truth = last_logits(ref, prompts)
    errs = {name: [rel_err(a, r) for a, r in zip(last_logits(llm, prompts), truth, strict=True)]
            for name, llm in bf16.items()}  # fmt: skip
    print(f"{ref.info.model}: relative error of the first sampled logits against float32\n")
    print("| residual | " + " | ".join(f"{n} tokens" for n in lengths) + " | worst |")
    print("|---" * (len(lengths) + 2) + "|")
    for name, row in errs.items():
        print(f"| {name} | " + " | ".join(f"{e:.4f}" for e in row) + f" | {max(row):.4f} |")


def chunked(args: argparse.Namespace) -> None:
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    print(f"| residual | same tokens | near-tie | clear winner | ({args.model}, "
          f"{'one at a time' if args.alone else 'all at once'})")  # fmt: skip
    print("|---|---|---|---|")
    for name, residual in RESIDUALS.items():
        kw = {**base(args), "dtype": "bfloat16", "residual_dtype": residual}
        whole = LLM(max_extend_tokens=8192, **kw)
        split = LLM(max_extend_tokens=64, **kw)
        split.model.load_state_dict(whole.model.state_dict())
        prompts = notes_prompts(whole, 32)
        if args.alone:
            a = [trace_run(whole, [p], params)[0] for p in prompts]
            b = [trace_run(split, [p], params)[0] for p in prompts]
        else:
            a, b = trace_run(whole, prompts, params), trace_run(split, prompts, params)
        c = compare_greedy(a, b, 32)
        print(f"| {name} | {c['same']} | {c['ties']} | {c['mismatches']} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.precision",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("what", choices=("logits", "chunked"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dummy", action="store_true", help="random weights from the config")
    ap.add_argument("--alone", action="store_true", help="chunked: one prompt at a time")
    args = ap.parse_args()
    logits(args) if args.what == "logits" else chunked(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
