"""One prompt step through `LLM`, timed and profiled: where a CPU prefill spends its time.

    python scripts/profile_prefill.py --lengths 216,1500 --threads 2
    python scripts/profile_prefill.py --sdpa 1500   # one layer's attention, 3-D against 4-D
    python scripts/profile_prefill.py --matmul 8,216,2048   # one layer's projections, BLAS / oneDNN

SmolLM2 in float32 with the naive cache (every run computes the whole prompt); each length is
warmed once, timed three times (the step record's t1 - t0, best of 3), then profiled once with
torch.profiler, printing the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", default="216,1500")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=12, help="operators shown per profile")
    p.add_argument(
        "--sdpa",
        type=int,
        default=0,
        help="only time one SmolLM2 attention layer "
        "at this many tokens on 3-D (math path) and 4-D (CPU flash kernel) input",
    )
    p.add_argument(
        "--matmul",
        default="",
        help="only time one SmolLM2 layer's four projections at these row counts (comma-separated) "
        "through F.linear (torch's BLAS) and through oneDNN on reordered weights (the engine's)",
    )
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM
    from instrumentation.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    if args.sdpa:
        return sdpa(args.sdpa)
    if args.matmul:
        return matmul([int(x) for x in args.matmul.split(",")])
    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(args.model, dtype="float32", max_extend_tokens=max(lengths), cache_type="naive",
              max_seq_len=max(lengths) + 8, progress=False)  # fmt: skip
    steps: list = []
    llm.add_step_hook(steps.append)
    ids = llm.encode("river stone light quiet seven paper north glass bread " * 400)
    one = SamplingParams(max_tokens=1)
    for n in lengths:
        prompt = ids[:n]
        llm.generate([prompt], one)
        times = []
        for _ in range(3):
            steps.clear()
            llm.generate([prompt], one)
            times.append(steps[0].t1 - steps[0].t0)
        print(f"{n}-token prompt step: {min(times) * 1e3:.0f} ms (best of 3)")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([prompt], one)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


def sdpa(t: int, heads: int = 9, kv_heads: int = 3, dim: int = 64) -> int:
    import time

    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(h, t, dim) for h in (heads, kv_heads, kv_heads))

    def best(*x: torch.Tensor) -> float:
        run = lambda: F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True)  # noqa: E731
        run()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return min(times)

    three = best(q, k, v)
    four = best(q[None], k[None], v[None])
    print(f"one attention layer, {t} tokens: 3-D {three * 1e3:.0f} ms, 4-D {four * 1e3:.0f} ms")
    return 0


def matmul(row_counts: list[int]) -> int:
    """SmolLM2's qkv, o, gate_up and down projections (float32), best of 20 each way."""
    import time

    import torch
    import torch.nn.functional as F

    from engine.models.kernels import onednn_linear, onednn_weight

    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
    weights = [torch.randn(o, i) * 0.05 for i, o in shapes]
    packed = [onednn_weight(w) for w in weights]
    if any(w is None for w in packed):
        print("oneDNN is not available in this torch")
        return 1

    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    print("| rows | F.linear (BLAS) | oneDNN | speed-up | GFLOP/s BLAS / oneDNN |")
    print("|---|---|---|---|---|")
    for n in row_counts:
        xs = [torch.randn(n, i) for i, _ in shapes]
        blas = best(lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)])
        dnn = best(
            lambda xs=xs: [onednn_linear(x, p, None) for x, p in zip(xs, packed, strict=True)]
        )
        flop = 2 * n * sum(i * o for i, o in shapes)
        print(f"| {n} | {blas * 1e3:.2f} ms | {dnn * 1e3:.2f} ms | {blas / dnn:.1f}x | "
              f"{flop / blas / 1e9:.0f} / {flop / dnn / 1e9:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
