"""What one step message says, and what a run of them says about a request: the tokens a step
computed (`step_tokens`, `step_recompute`), which items sampled (`samples`), and the stalls in a
run of steps (`stalls`, by `instrumentation.metrics.stalled_between`). Torch-free; the fold,
the summaries and the trace export read steps through these."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from instrumentation.metrics import stalled_between
from instrumentation.protocol import SAMPLING_KINDS

Message = dict[str, Any]


def step_tokens(step: Message) -> tuple[int, int]:
    """(prompt tokens, sampled tokens) a step computed; wasted work not counted. Aggregate
    steps (watched engines) carry the counts instead of items."""
    items = step.get("items")
    if not items:
        return int(step.get("prompt_tokens") or 0), int(step.get("decode_requests") or 0)
    prompt = output = 0
    for item in items:
        if item.get("wasted"):
            continue
        kind = item.get("kind")
        if kind not in ("decode", "recompute"):
            prompt += int(item["end"]) - int(item["start"])
        output += samples(item)
    return prompt, output


def samples(item: Message) -> bool:
    """Whether a step item sampled a token: every prefill and decode, and the `recompute` piece
    that ends a retracted request's recompute (marked `sample`, v1.3); never a chunk, never
    wasted work."""
    if item.get("wasted"):
        return False
    return item.get("kind") in SAMPLING_KINDS or bool(item.get("sample"))


def step_recompute(step: Message) -> tuple[int, int]:
    """(requests retracted, tokens recomputed) in a step (v1.3)."""
    recomputed = sum(
        int(i["end"]) - int(i["start"])
        for i in step.get("items") or ()
        if i.get("kind") == "recompute" and not i.get("wasted")
    )
    return len(step.get("retracted") or ()), recomputed


@dataclass(frozen=True, slots=True)
class Stall:
    """Steps `[first, last]` (indices into the step list) in which request `uid`, already
    sampling, got no token; `seconds` from its token before to its token after (or to the last
    step, if it is still waiting: `ongoing`)."""

    uid: int
    first: int
    last: int
    seconds: float
    ongoing: bool


def token_steps(steps: Sequence[Message]) -> dict[int, list[int]]:
    """For each request, the indices of the steps in which it sampled a token."""
    out: dict[int, list[int]] = {}
    for i, step in enumerate(steps):
        for item in step.get("items") or ():
            if samples(item):
                out.setdefault(item["uid"], []).append(i)
    return out


def stalls(
    steps: Sequence[Message],
    running: Iterable[int] = (),
    sampled: dict[int, list[int]] | None = None,
) -> list[Stall]:
    """Every stall within `steps`; a request in `running` whose last token is before the last
    step is stalled still (`ongoing`). `sampled` is `token_steps(steps)`, if already known."""
    if not steps:
        return []
    sampled = token_steps(steps) if sampled is None else sampled
    numbers = [s["step"] for s in steps]
    running = set(running)
    last = len(steps) - 1
    out: list[Stall] = []
    for uid, toks in sampled.items():
        for a, b in zip(toks, toks[1:], strict=False):
            if stalled_between(numbers[a], numbers[b]):
                out.append(Stall(uid, a + 1, b - 1, steps[b]["t1"] - steps[a]["t1"], False))
        if toks and toks[-1] < last and uid in running:
            secs = steps[last]["t1"] - steps[toks[-1]]["t1"]
            out.append(Stall(uid, toks[-1] + 1, last, secs, True))
    return out
