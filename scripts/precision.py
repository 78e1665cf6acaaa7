"""How far bfloat16 logits are from float32 ones on the same weights, with the usual bfloat16
residual stream and with a float32 one (`residual_dtype="float32"`). Runs anywhere; on CPU,
bfloat16 matmuls accumulate in float32 as tensor cores do.

    python scripts/precision.py --model smollm2
    python scripts/precision.py --model assets/qwen3-0.6b --dummy    # the Qwen3-0.6B shape

Prints one row per prompt: the relative error ||bf16 - fp32|| / ||fp32|| of the logits the
first token is sampled from.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM  # noqa: E402
from tests.test_precision import last_logits, rel_err  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dummy", action="store_true", help="random weights from the config")
    ap.add_argument("--lengths", default="16,40,100,200,300,450", help="prompt lengths")
    args = ap.parse_args()
    kw = dict(
        model=args.model,
        load_format="dummy" if args.dummy else "auto",
        max_seq_len=512,
        num_pages=2048,
        max_running_req=2,
        progress=False,
    )
    plain = LLM(dtype="bfloat16", **kw)  # type: ignore[arg-type]
    wide = LLM(dtype="bfloat16", residual_dtype="float32", **kw)  # type: ignore[arg-type]
    ref = LLM(dtype="float32", **kw)  # type: ignore[arg-type]
    weights = plain.model.state_dict()
    wide.model.load_state_dict(weights)
    ref.model.load_state_dict({k: v.float() for k, v in weights.items()})
    rng = random.Random(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]
    truth = last_logits(ref, prompts)
    rows = zip(lengths, last_logits(plain, prompts), last_logits(wide, prompts), truth, strict=True)
    print(f"| prompt tokens | bf16 residual | float32 residual |  ({plain.info.model})")
    print("|---|---|---|")
    for n, a, b, r in rows:
        print(f"| {n} | {rel_err(a, r):.4f} | {rel_err(b, r):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
