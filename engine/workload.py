"""Seeded open-loop workloads: Poisson arrivals, or arrivals replayed from a production trace.

Torch-free: a workload is a list of `Arrival`s (when, how many prompt tokens, how many output
tokens), built before the engine starts so every run of a sweep sees the same requests.

Two sources (docs/benchmarks.md, "Policy and budget trade-off (the sweep)"):
- `poisson(rate, duration, lengths, seed)`: exponential inter-arrival gaps at `rate` requests per
  second for `duration` seconds; each request's (prompt, output) pair is drawn, with replacement,
  from `lengths` (by default the Azure conversation trace in assets/azure/).
- `replay(rows, ...)`: the trace's own arrival times and lengths, from a starting row on.

A production trace is measured on large models and machines, so both are scaled:
- time: `rate` compresses or stretches the trace's clock so its mean arrival rate becomes `rate`
  (the gaps keep their shape, bursts stay bursts);
- lengths: prompt and output token counts are multiplied by `Scaling.length_scale` (rounded, at
  least 1) and clamped to `max_prompt` / `max_output`, and their sum to the model's
  `max_seq_len`. A small model on a 2-core CPU computes ~10x fewer tokens per second than a GPU
  serving a 7B model, so a CPU sweep scales lengths by 1/8 and the rate down to what the machine
  can serve; the H200 keeps the trace's lengths.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "azure"
AZURE_CONV = ASSETS / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = ASSETS / "AzureLLMInferenceTrace_code.csv"


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One production request: `t` seconds after the trace's first request."""

    t: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a workload: submitted `t` seconds after the run starts."""

    t: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class Scaling:
    """How trace lengths become this model's: multiply, round, clamp (see the module doc)."""

    length_scale: float = 1.0
    max_prompt: int | None = None
    max_output: int | None = None
    max_seq_len: int | None = None  # prompt + output never exceeds it (the engine refuses more)

    def __post_init__(self) -> None:
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")
        for name in ("max_prompt", "max_output", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError("max_seq_len must leave room for one prompt and one output token")

    def apply(self, context_tokens: int, generated_tokens: int) -> tuple[int, int]:
        prompt = max(1, round(context_tokens * self.length_scale))
        output = max(1, round(generated_tokens * self.length_scale))
        if self.max_prompt is not None:
            prompt = min(prompt, self.max_prompt)
        if self.max_output is not None:
            output = min(output, self.max_output)
        if self.max_seq_len is not None and prompt + output > self.max_seq_len:
            # keep the output (what ITL is measured on) and shorten the prompt first
            output = min(output, self.max_seq_len // 2)
            prompt = min(prompt, self.max_seq_len - output)
        return prompt, output


def read_trace(path: str | Path) -> list[TraceRow]:
    """An Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), sorted by
    time, with times in seconds from its first row."""
    rows: list[tuple[datetime, int, int]] = []
    with Path(path).open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace, missing columns {sorted(missing)}")
        for rec in reader:
            rows.append(
                (
                    _timestamp(rec["TIMESTAMP"]),
                    int(rec["ContextTokens"]),
                    int(rec["GeneratedTokens"]),
                )
            )
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    return [TraceRow((ts - start).total_seconds(), c, g) for ts, c, g in rows]


def _timestamp(text: str) -> datetime:
    # the trace has 7 fractional digits (100 ns); datetime takes at most 6
    text = text.strip()
    if "." in text:
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text)


def trace_rate(rows: Sequence[TraceRow]) -> float:
    """Mean arrivals per second over the trace's span."""
    if len(rows) < 2 or rows[-1].t <= rows[0].t:
        raise ValueError("a rate needs at least two rows at different times")
    return (len(rows) - 1) / (rows[-1].t - rows[0].t)


def poisson(
    rate: float,
    duration: float,
    lengths: Sequence[TraceRow],
    scaling: Scaling = Scaling(),
    seed: int = 0,
) -> list[Arrival]:
    """Arrivals at `rate` per second (exponential gaps) within `[0, duration)`, each with a
    (prompt, output) pair drawn from `lengths`."""
    if not rate > 0 or not duration > 0:
        raise ValueError(f"rate and duration must be > 0, got {rate} and {duration}")
    if not lengths:
        raise ValueError("no lengths to draw from")
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < duration:
        row = lengths[rng.randrange(len(lengths))]
        out.append(Arrival(t, *scaling.apply(row.context_tokens, row.generated_tokens)))
        t += rng.expovariate(rate)
    return out


def replay(
    rows: Sequence[TraceRow],
    scaling: Scaling = Scaling(),
    rate: float | None = None,
    duration: float | None = None,
    start: int = 0,
    limit: int | None = None,
) -> list[Arrival]:
    """The trace's requests from row `start` on, the first one at t=0. `rate`: rescale the
    trace's clock so its mean rate (over the rows used) becomes `rate`; `duration`: keep the
    arrivals before it (scaled seconds); `limit`: at most this many requests."""
    if not 0 <= start < len(rows):
        raise ValueError(f"start row {start} is outside the trace's {len(rows)} rows")
    part = list(rows[start:])
    if limit is not None:
        part = part[:limit]
    factor = 1.0
    if rate is not None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if len(part) >= 2:
            factor = (
                trace_rate(part) / rate if duration is None else _rate_over(part, duration, rate)
            )
    t0 = part[0].t
    out = []
    for row in part:
        t = (row.t - t0) * factor
        if duration is not None and t >= duration:
            break
        out.append(Arrival(t, *scaling.apply(row.context_tokens, row.generated_tokens)))
    return out


def _rate_over(part: Sequence[TraceRow], duration: float, rate: float) -> float:
    """The clock factor under which `part` arrives at `rate` per second: measured over the
    stretch of trace that `duration` scaled seconds will cover, so a short slice of a bursty
    trace gets the rate asked for, not the whole trace's."""
    # the stretch covers about rate * duration requests
    n = max(2, min(len(part), math.ceil(rate * duration) + 1))
    return trace_rate(part[:n]) / rate


def describe(arrivals: Sequence[Arrival]) -> str:
    """One line for logs and reports: count, span, mean rate, prompt and output lengths."""
    if not arrivals:
        return "no requests"
    span = arrivals[-1].t
    prompts = sorted(a.prompt_len for a in arrivals)
    outputs = sorted(a.output_len for a in arrivals)
    mid = len(arrivals) // 2
    rate = f"{(len(arrivals) - 1) / span:.2f}/s" if span > 0 else "at once"
    return (
        f"{len(arrivals)} requests over {span:.1f} s ({rate}); prompt median {prompts[mid]} "
        f"max {prompts[-1]}, output median {outputs[mid]} max {outputs[-1]} tokens"
    )
