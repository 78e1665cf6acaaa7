"""Runs the sections in order, each isolated (one failing prints its traceback and the rest still
run), within a deadline.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import engine.step
import scripts.gpu_check as gpu_check
from scripts.gpu_check.common import FoldedDetokenizer
from scripts.gpu_check.report import Report

# section name -> its module in this package, in the order they run
SECTION_MODULES = {
    "warmup": "warmup", "pytest": "gpu_tests", "bandwidth": "bandwidth", "gemv": "gemv",
    "decode": "decode", "logits": "logits", "backends": "backends", "chunked": "chunked",
    "syncs": "syncs", "profile": "profile_step", "kernels": "kernels", "gap": "gap",
    "bench": "bench", "overhead": "overhead", "stall": "stall", "hf": "hf", "hf_static": "hf",
    "smollm2": "smollm2",
}  # fmt: skip
SECTIONS = tuple(SECTION_MODULES)


def section_fn(name: str) -> Callable[[Report], None]:
    """The section's function, `sec_<name>` of its module (imported when it runs)."""
    module = importlib.import_module(f"scripts.gpu_check.{SECTION_MODULES[name]}")
    return getattr(module, f"sec_{name}")


# -- sections ------------------------------------------------------------------------------
def sec_env(r: Report) -> None:
    import transformers

    try:
        import flashinfer

        fi = flashinfer.__version__
    except Exception as e:
        fi = f"not importable: {e}"
    props = torch.cuda.get_device_properties(0)
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": fi,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    r.data["env"] = env
    r.table("Environment", ["what", "value"], [[k, v] for k, v in env.items()])


# -- main ----------------------------------------------------------------------------------
def run_sections(r: Report, names: list[str], section: Callable[[str], None]) -> None:
    """Run each named section in turn, timed; a failure is recorded in the report, not raised,
    and what would start with under 10 s left is skipped."""
    for name in names:
        if r.left() < 10:
            r.say(f"\n(skipped section {name}: out of time)\n")
            continue
        t = time.perf_counter()
        print(f"\n=== {name} (at {r.elapsed():.0f} s) ===", flush=True)
        try:
            section(name)
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            r.say(f"\n### {name}: FAILED\n\n```\n{tb[-2500:]}\n```\n")
        r.data.setdefault("section_s", {})[name] = time.perf_counter() - t
        r.save()
    r.say(f"\nTotal {r.elapsed():.0f} s.")
    r.save()


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python3 -m scripts.gpu_check",
        description=gpu_check.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu")))
    ap.add_argument("--sections", default=",".join(s for s in SECTIONS if s != "hf_static"))
    ap.add_argument("--hf-static-batches", default="64,1,16,256")
    ap.add_argument(
        "--pytest-files",
        default="tests/gpu/test_gpu.py,tests/engine/test_batch_invariant.py",
        help="what the pytest section runs",
    )
    ap.add_argument(
        "--bench-quick",
        action="store_true",
        help="bench: batches 1 and 64 of the default path and the precision options only",
    )
    ap.add_argument(
        "--smollm2-greedy-only",
        action="store_true",
        help="smollm2: the greedy comparison against Hugging Face only",
    )
    ap.add_argument("--deadline-s", type=float, default=540.0, help="skip what would start later")
    args = ap.parse_args()
    # random-weight models sample ids the bundled tokenizer does not know (FoldedDetokenizer)
    engine.step.IncrementalDetokenizer = FoldedDetokenizer  # type: ignore[misc]
    r = Report(args.out, args.deadline_s)
    r.pytest_files = args.pytest_files.split(",")
    r.bench_quick = args.bench_quick
    r.smollm2_greedy_only = args.smollm2_greedy_only
    wanted = args.sections.split(",")
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
    r.say(f"# GPU check ({' '.join(sys.argv)})\n")
    sec_env(r)

    def section(name: str) -> None:
        if name == "hf_static":
            section_fn(name)(r, [int(b) for b in args.hf_static_batches.split(",")])  # type: ignore[call-arg]
        else:
            section_fn(name)(r)

    run_sections(r, [n for n in SECTIONS if n in wanted], section)
    return 0
