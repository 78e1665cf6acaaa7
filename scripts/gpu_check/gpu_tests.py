"""pytest: the GPU tests (tests/gpu/test_gpu.py and the files --pytest-files names)."""

from __future__ import annotations

import subprocess
import sys
import time

from scripts.gpu_check.common import REPO
from scripts.gpu_check.report import Report


def sec_pytest(r: Report) -> None:
    t = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *r.pytest_files,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=max(60.0, min(400.0, r.left())),
    )
    # the whole output beside the report: a failure's traceback is above the summary
    (r.out / "pytest.txt").write_text(proc.stdout + "\n" + proc.stderr[-20000:])
    tail = proc.stdout.strip().splitlines()[-25:]
    r.data["pytest"] = {"rc": proc.returncode, "tail": tail, "s": time.perf_counter() - t}
    r.say(f"\n### pytest {' '.join(r.pytest_files)}\n\n```\n" + "\n".join(tail) + "\n```\n")
    if proc.returncode != 0:
        print(proc.stderr[-3000:], flush=True)
