"""Does tensor parallelism reproduce one GPU, and what does it buy? For a machine with two GPUs.

    python -m bench.tp --out DIR [--sections warmup,exact,bench]
    python -m bench.tp --dry-run --out /tmp/tp --sections exact,bench   # on CPU, anywhere

Sections, in order (each isolated: one failing prints its traceback and the rest still run):
  warmup  FlashInfer's JIT kernels, built once before any engine (as bench.gpu does)
  exact   tp_size=2 against tp_size=1, greedy tokens and logits of the same prompts: Qwen3-0.6B
          and Llama-3.1-8B shapes with random weights (graphs and overlap on, and both off),
          SmolLM2 (uneven heads: 2 and 1 KV heads) when its weights are here
  bench   decode step times at batch 1 and 64 (512-token prompts, 128 new tokens), tp_size 1
          and 2, both shapes: the step, each rank's share (its CUDA events), and the NCCL
          kernels' time per step on rank 0 (torch.profiler), the all-reduce and logits gather

Dummy weights are the same at every tp_size (each rank keeps its slices of the whole model's
draw), so tp_size=2 must reproduce tp_size=1 up to the order of bf16 sums in the all-reduce:
`compare_greedy` counts a divergence at a near-tie apart from a real mismatch. `--dry-run` runs
the same code on CPU over gloo at a tiny shape (a check of this tool where no GPU is). Markdown
to stdout and DIR/tp.md, raw numbers to DIR/tp.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine.step
from bench.gpu.common import (
    QWEN,
    FoldedDetokenizer,
    Report,
    decode_times,
    drive,
    environment,
    flashinfer_missing,
    jit_warmup,
    rand_ids,
    weight_bytes,
)
from bench.gpu.real_weights import smollm2_path
from checks.greedy import compare_greedy, trace_run
from engine import LLM
from instrumentation.sampling import SamplingParams

# random-weight models sample ids the bundled tokenizer does not know (the worker ranks, which
# import this module, too)
engine.step.IncrementalDetokenizer = FoldedDetokenizer  # type: ignore[misc]

REPO = Path(__file__).resolve().parents[1]
LLAMA8B = REPO / "assets" / "llama3-8b"
SECTIONS = ("warmup", "exact", "bench")
PROMPT_LEN, NEW_TOKENS, BATCHES = 512, 128, (1, 64)
SHAPES = {"Qwen3-0.6B": (QWEN, 151936), "Llama-3.1-8B": (LLAMA8B, 128256)}
DEVICE = "cuda"


def dry_run() -> None:
    """--dry-run: the same code on CPU over gloo, at the tiny shape and small sizes (a check of
    the script's logic where no GPU is)."""
    global PROMPT_LEN, NEW_TOKENS, BATCHES, SHAPES, DEVICE
    PROMPT_LEN, NEW_TOKENS, BATCHES, DEVICE = 24, 4, (1, 4), "cpu"
    SHAPES = {"tiny-llama": (REPO / "assets" / "tiny-llama", 49152)}


class TPReport(Report):
    """bench.gpu's report, saved as tp.md and tp.json."""

    def save(self) -> None:
        (self.out / "tp.md").write_text("\n".join(self.md) + "\n")
        (self.out / "tp.json").write_text(json.dumps(self.data, indent=1, default=str))


def engine(path: Path, tp_size: int, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        model=str(path), device=DEVICE, load_format="dummy", progress=False, tp_size=tp_size,
        max_running_req=64, max_seq_len=1024, page_size=16, num_pages=64 * 680 // 16,
        max_extend_tokens=16384, cache_type="naive",
    )  # fmt: skip
    return LLM(**{**args, **kw})


def dispose(llm: LLM) -> None:
    llm.close()  # the worker ranks and the process group
    del llm
    import gc

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# -- exact -------------------------------------------------------------------------------------
def exact(r: Report) -> None:
    headers = ["model", "variant", "prompts", "same", "ties", "mismatches", "worst rel err"]
    rows: list[list[Any]] = []
    variants: list[tuple[str, dict[str, Any]]] = [
        ("graphs + overlap", {}),
        ("eager, no overlap", {"cuda_graph": False, "overlap": False}),
    ]
    for name, (path, vocab) in SHAPES.items():
        rng = random.Random(11)
        prompts = [rand_ids(rng.randrange(32, 400), rng, vocab) for _ in range(8)]
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        for label, kw in variants if name == "Qwen3-0.6B" else variants[:1]:
            if r.left() < 90:
                r.say(f"(skipped exact {name} {label}: past the deadline)")
                continue
            one = engine(path, 1, **kw)
            ref = trace_run(one, prompts, params)
            dispose(one)
            two = engine(path, 2, **kw)
            got = trace_run(two, prompts, params)
            dispose(two)
            c = compare_greedy(ref, got, 32)
            rows.append([name, label, len(prompts), c["same"], c["ties"], c["mismatches"],
                         c["worst_rel_err"]])  # fmt: skip
            r.data.setdefault("exact", []).append({"model": name, "variant": label, **c})
    smol = smollm2_path() if DEVICE == "cuda" else None
    if smol is not None and r.left() > 90:
        kw = dict(model=str(smol), load_format="auto", max_seq_len=1024)
        one = engine(smol, 1, **kw)
        prompts = [one.encode(p) for p in ("1 + 1 =", "The capital of France is")]
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        ref = trace_run(one, prompts, params)
        dispose(one)
        two = engine(smol, 2, **kw)
        assert (two.model.num_heads, two.model.num_kv_heads) == (6, 2)
        got = trace_run(two, prompts, params)
        dispose(two)
        c = compare_greedy(ref, got, 32)
        rows.append(["SmolLM2-135M (KV heads 2 + 1)", "graphs + overlap", len(prompts),
                     c["same"], c["ties"], c["mismatches"], c["worst_rel_err"]])  # fmt: skip
    r.table("tp_size=2 against tp_size=1: greedy tokens and logits", headers, rows)


# -- bench -------------------------------------------------------------------------------------
def comm_ms_per_step(llm: LLM, batch: int, steps: int, rng: random.Random) -> float:
    """Rank 0's time in collectives per decode step (the all-reduces and the logits gather),
    from torch.profiler over `steps` decode steps: NCCL kernels' device time on CUDA, where a
    kernel also waits for the other rank; gloo calls' wall time on CPU (--dry-run)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        llm.submit(rand_ids(PROMPT_LEN, rng), params)
    while llm.num_waiting():  # through the prefill ...
        llm.step()
    for _ in range(3):  # ... and its last chunks: decode steps only from here
        llm.step()
    cuda = DEVICE == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
        if cuda:
            torch.cuda.synchronize()
    while llm.has_work():
        llm.step()
    name = "nccl" if cuda else "gloo"
    events = [e for e in prof.key_averages() if name in e.key.lower()]
    us = sum(e.device_time_total if cuda else e.cpu_time_total for e in events)
    return us / 1000 / steps


def bench(r: Report) -> None:
    headers = ["model", "tp", "batch", "step ms (median)", "decode tok/s", "rank 0 ms",
               "rank 1 ms", "collectives ms/step (rank 0)", "weights GB/GPU"]  # fmt: skip
    rows: list[list[Any]] = []
    for name, (path, vocab) in SHAPES.items():
        for tp in (1, 2):
            if r.left() < 120:
                r.say(f"(skipped bench {name} tp={tp}: past the deadline)")
                continue
            llm = engine(path, tp)
            records: list[Any] = []
            llm.add_step_hook(records.append)
            wgb = weight_bytes(llm) / 1e9
            for bs in BATCHES:
                rng = random.Random(bs)
                records.clear()
                params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
                run = drive(llm, [rand_ids(PROMPT_LEN, rng, vocab) for _ in range(bs)], params)
                dec = decode_times(run, bs)
                med = statistics.median(dec)
                ranks = [_rank_ms(records, bs, k) for k in range(tp)] + [None] * (2 - tp)
                comm = comm_ms_per_step(llm, bs, 20, rng) if tp > 1 else None
                rows.append([name, tp, bs, med * 1e3, bs / med, *ranks, comm, wgb])
                r.data.setdefault("bench", []).append(
                    {"model": name, "tp": tp, "batch": bs, "step_ms": med * 1e3,
                     "rank_ms": ranks, "comm_ms": comm, "weights_gb": wgb}
                )  # fmt: skip
            dispose(llm)
    what = "CUDA graphs and overlap on" if DEVICE == "cuda" else "CPU, gloo"
    r.table(
        f"Decode steps with tensor parallelism ({PROMPT_LEN}-token prompts, {NEW_TOKENS} new "
        f"tokens; {what})",
        headers,
        rows,
    )


def _rank_ms(records: list[Any], batch: int, rank: int) -> float | None:
    xs = [
        rec.ranks[rank].forward_s
        for rec in records
        if rec.phase == "decode" and len(rec.items) == batch and rec.ranks is not None
    ]
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) * 1e3 if xs else None


# -- main --------------------------------------------------------------------------------------
def warmup(r: Report) -> None:
    if (missing := flashinfer_missing()) is not None:
        r.say(f"(no warm-up: {missing})")
        return
    times = jit_warmup()
    r.data["warmup_s"] = times
    r.table("FlashInfer JIT builds", ["module", "seconds"], [[k, v] for k, v in times.items()])


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=Path("out/tp"))
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--deadline-s", type=float, default=None, help="skip what would start later")
    ap.add_argument("--dry-run", action="store_true", help="on CPU, tiny shape (no GPU needed)")
    args = ap.parse_args()
    wanted = args.sections.split(",")
    if unknown := set(wanted) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    if args.dry_run:
        dry_run()
    elif torch.cuda.device_count() < 2:
        print(f"bench.tp needs two CUDA devices; torch sees {torch.cuda.device_count()} "
              "(--dry-run runs it on CPU)", file=sys.stderr)  # fmt: skip
        return 2
    r = TPReport(args.out, args.deadline_s or float("inf"))
    r.say(f"# bench.tp ({' '.join(sys.argv[1:])})\n")
    if DEVICE == "cuda":
        environment(r)
    run: dict[str, Callable[[Report], None]] = {"warmup": warmup, "exact": exact, "bench": bench}
    for name in [n for n in SECTIONS if n in wanted and (n != "warmup" or DEVICE == "cuda")]:
        if r.left() < 10:
            r.say(f"\n(skipped section {name}: past the deadline)\n")
            continue
        t = time.perf_counter()
        print(f"\n=== {name} (at {r.elapsed():.0f} s) ===", flush=True)
        try:
            run[name](r)
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            r.say(f"\n### {name}: FAILED\n\n```\n{tb[-2500:]}\n```\n")
        r.data.setdefault("section_s", {})[name] = time.perf_counter() - t
        r.save()
    r.say(f"\nTotal {r.elapsed():.0f} s.")
    r.save()
    return 0


if __name__ == "__main__":  # the worker ranks import this module too (spawn): nothing above runs
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
