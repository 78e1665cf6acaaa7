"""`python -m bench.gpu`: the environment, FlashInfer's JIT warm-up, then each section in turn
(see __init__.py), within a deadline."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

import bench.gpu as package

SECTIONS = ("decode", "chunk", "mixed", "serving", "stall", "exactness", "kernels")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, in order")
    ap.add_argument("--out", type=Path, default=Path("out/bench-gpu"), help="where the tables go")
    ap.add_argument("--deadline-s", type=float, default=None, help="skip what would start later")
    ap.add_argument("--batches", default="1,64", help="decode: the batches measured")
    ap.add_argument("--hf-static-batches", default="1,64", help="decode: HF's static cache "
                    "(compiled on first use, minutes); empty: skip it")  # fmt: skip
    ap.add_argument("--no-warmup", action="store_true", help="skip FlashInfer's JIT warm-up")
    ap.add_argument("--fa3", action="store_true", help="build Hopper's fa3 prefill and its "
                    "page-index module in the warm-up too (minutes)")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s]
    if unknown := sorted(set(wanted) - set(SECTIONS)):
        ap.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA device, and torch sees none here "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
              "The other benchmarks run anywhere: `python -m bench` lists them.",
              file=sys.stderr)  # fmt: skip
        return 2
    import engine.step
    from bench.gpu.common import (
        FoldedDetokenizer,
        Report,
        environment,
        flashinfer_missing,
        free,
        jit_warmup,
    )

    # random-weight models sample ids the bundled tokenizer does not know
    engine.step.IncrementalDetokenizer = FoldedDetokenizer  # type: ignore[misc]
    r = Report(args.out, args.deadline_s or float("inf"))
    r.say(f"# bench.gpu ({' '.join(sys.argv[1:])})\n")
    environment(r)
    if (missing := flashinfer_missing()) is not None:
        r.say(f"\nFlashInfer: {missing}. The engine runs torch attention; what compares against "
              "FlashInfer is skipped.\n")  # fmt: skip
    elif not args.no_warmup:
        times = jit_warmup(fa3=args.fa3)
        r.data["warmup_s"] = times
        r.table("FlashInfer JIT builds", ["module", "seconds"], [[k, v] for k, v in times.items()])
    for name in [s for s in SECTIONS if s in wanted]:
        if r.left() < 10:
            r.say(f"\n(skipped section {name}: past the deadline)\n")
            continue
        t = time.perf_counter()
        print(f"\n=== {name} (at {r.elapsed():.0f} s) ===", flush=True)
        try:
            importlib.import_module(f"bench.gpu.{name}").run(r, args)
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            r.say(f"\n### {name}: FAILED\n\n```\n{tb[-2500:]}\n```\n")
        free()  # what the section left behind goes back to the device before the next
        r.data.setdefault("section_s", {})[name] = time.perf_counter() - t
        r.save()
    r.say(f"\nTotal {r.elapsed():.0f} s; tables in {args.out / 'bench_gpu.md'}.")
    r.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
