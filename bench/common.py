"""What the benchmarks share: the table they print, model names they accept ('tiny'), prompts
of natural text, and the decode period of a run's step records."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TEXT = (
    "The harbour master kept a ledger of every boat that left at dawn and every boat that came "
    "back at dusk, and in the margins he wrote what the sea had been like that day. "
)

NOTES = (
    "The river floods every spring after the snow melts in the hills.",
    "Our team meets on Tuesdays to review the open tickets.",
    "The bakery on the corner sells rye bread until noon.",
    "Copper conducts heat far better than stainless steel does.",
    "The museum's east wing reopens after the roof repairs.",
    "Most migratory birds fly south along the coastline.",
    "The train to the airport leaves every twenty minutes.",
    "A good sourdough starter needs flour, water and patience.",
    "The library extended its opening hours during exams.",
    "Solar panels produce less power on cloudy winter days.",
    "The city council approved a new bicycle lane downtown.",
    "Tomatoes ripen faster when stored next to bananas.",
)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, numbers right-aligned; floats to 3 decimals."""
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


def flat(values: Sequence[str], kind: type = int) -> list[Any]:
    """`--budgets 32,128 512` → [32, 128, 512]: commas and spaces both separate."""
    return [kind(v) for value in values for v in str(value).split(",") if v]


def model_path(name: str, tmp: Path) -> str:
    """A model argument as the engine takes it; 'tiny' is a tiny random-weight Llama made in
    `tmp` with the bundled tokenizer (what the tests run), anything else is passed through
    (a directory as an absolute path, so a server started elsewhere finds it)."""
    if name != "tiny":
        return str(Path(name).resolve()) if Path(name).is_dir() else name
    from checks.models import make_tiny
    from engine.models.loader import resolve

    return str(make_tiny("llama", tmp / "tiny", resolve("smollm2", progress=False).path))


def prompt_of(llm: Any, n_tokens: int, salt: int) -> list[int]:
    """A natural-text prompt of exactly n_tokens; `salt` makes it differ from its siblings."""
    ids = llm.tokenizer.encode(f"Story {salt}. " + TEXT * (n_tokens // 20 + 2))
    return ids[:n_tokens]


def notes_prompts(llm: Any, n: int) -> list[list[int]]:
    """Chat prompts of 150 to 900 tokens: notes to summarize, each its own mix."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        body = " ".join(rng.choice(NOTES) for _ in range(rng.randint(10, 65)))
        text = f"Here are my notes:\n{body}\nSummarize the notes in two sentences."
        out.append(llm.encode(text, chat=True))
    return out


def decode_period(steps: Sequence[Any], n: int) -> float:
    """The median period between decode steps that held all `n` requests: the gap between
    consecutive steps' completions (under overlap scheduling a record's t1 - t0 spans the next
    step's launch too, about 2x the period). NaN if there were none."""
    done = [s.t1 for s in steps]
    full = [b - a for a, b, s in zip(done, done[1:], steps[1:], strict=False)
            if s.phase == "decode" and len(s.items) == n]  # fmt: skip
    return statistics.median(full) if full else float("nan")
