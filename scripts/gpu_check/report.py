"""The report every section writes to: Markdown tables on stdout and OUT/gpu_check.md, raw
numbers in OUT/gpu_check.json, both rewritten after every section; and the one event hook
(`Switch`) the bench, overhead and stall sections share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import LLM


# -- report --------------------------------------------------------------------------------
class Report:
    def __init__(self, out: Path, deadline_s: float) -> None:
        self.out, self.deadline_s = out, deadline_s
        self.t0 = time.monotonic()
        self.md: list[str] = []
        self.data: dict[str, Any] = {}
        self.bench_llm: LLM | None = None  # shared by bench, overhead and stall
        self.switch: Switch | None = None  # the one event hook those sections install
        self.pytest_files: list[str] = []
        self.bench_quick = False
        self.smollm2_greedy_only = False
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline_s - self.elapsed()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.md.append(text)

    def table(self, title: str, headers: list[str], rows: list[list[Any]]) -> None:
        lines = [f"\n### {title}\n", "| " + " | ".join(headers) + " |"]
        lines.append("|" + "---|" * len(headers))
        lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
        self.say("\n".join(lines) + "\n")

    def save(self) -> None:
        (self.out / "gpu_check.md").write_text("\n".join(self.md) + "\n")
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0 or 0.01 <= abs(v) < 1e5:
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return f"{v:.2e}"
    if isinstance(v, int) and abs(v) >= 10000:
        return f"{v:,}"
    return str(v)


class Switch:
    """One event hook whose target can change: None (bare), JSON serialization, or the server's."""

    def __init__(self) -> None:
        self.target: Callable[[Any], None] | None = None

    def __call__(self, ev: Any) -> None:
        if self.target is not None:
            self.target(ev)
