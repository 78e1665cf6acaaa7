"""How one step's time is divided among its pieces, for the delay (instrumentation.delay).

A step's *span* is its time: from the later of its `t0` and the previous step's `t1` to its `t1`
(with overlap a step is scheduled while the previous one runs; its span is what it added); the
time before it when no step ran is host time. The *cost split* divides the span: the step's
decodes together cost what a decode-only step of as many decodes costs in this run
(`DecodeEstimate`, never more than the span), shared equally; its prompt pieces (chunk, prefill,
recompute) share the rest by tokens. The *token split* divides it by tokens, a decode counting
one. Pure Python, no torch.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["DecodeEstimate", "StepSplit", "split_step"]

Message = dict[str, Any]
# the waiting reason of a stream that names none (recordings from before protocol v1.3)
UNKNOWN_REASON = "unknown"
# decode-only samples kept per batch-size bucket: recent enough to follow a change of load
_SAMPLES = 64


class DecodeEstimate:
    """What a decode-only step of `b` decodes costs in this run: the running median of the last
    spans of decode-only steps in its batch-size bucket; between known buckets interpolated
    linearly, beyond them a least-squares line (slope at least 0) over the buckets' medians.
    None before any decode-only step. Fed in step order, so every consumer of one stream gets
    the same estimates."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[int, float]]] = {}
        self._medians: dict[int, tuple[float, float]] = {}  # bucket -> (its batch size, median)

    @staticmethod
    def bucket(b: int) -> int:
        # exact up to 16 decodes, then quarter-octaves (about 19% apart)
        return b if b <= 16 else 16 + round(4 * math.log2(b / 16))

    def add(self, b: int, seconds: float) -> None:
        key = self.bucket(b)
        q = self._samples.get(key)
        if q is None:
            q = self._samples[key] = deque(maxlen=_SAMPLES)
        q.append((b, seconds))
        self._medians.pop(key, None)

    def _median(self, key: int) -> tuple[float, float]:
        m = self._medians.get(key)
        if m is None:
            q = self._samples[key]
            sizes = sorted(s for s, _ in q)
            spans = sorted(d for _, d in q)
            m = self._medians[key] = (float(sizes[len(sizes) // 2]), _mid(spans))
        return m

    def __call__(self, b: int) -> float | None:
        if not self._samples:
            return None
        key = self.bucket(b)
        if key in self._samples:
            return self._median(key)[1]
        points = sorted(self._median(k) for k in self._samples)
        i = bisect_left(points, (float(b), -math.inf))
        if 0 < i < len(points):
            (b0, d0), (b1, d1) = points[i - 1], points[i]
            return d0 + (d1 - d0) * (b - b0) / (b1 - b0) if b1 > b0 else d0
        return _line(points, b)


def _mid(xs: list[float]) -> float:
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _line(points: list[tuple[float, float]], b: int) -> float:
    if len(points) == 1:
        return points[0][1]
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in points) / sxx) if sxx else 0.0
    return max(0.0, my + slope * (b - mx))


@dataclass(slots=True)
class StepSplit:
    """One step as the delay divides it: its `span` (starting at `start`), its pieces by uid
    (`items`: the step message's items), `decode_part` what its decodes together cost (the
    rest, `prompt_part`, is its prompt pieces'), and the splits, made when first asked for."""

    step: int
    t0: float
    t1: float
    start: float
    span: float
    items: dict[int, Message]
    decodes: int
    prompt_tokens: int
    decode_part: float
    retracted: frozenset[int] | tuple[()]
    reason: str
    _cost: dict[int, float] | None = None
    _tokens: dict[int, float] | None = None

    @property
    def prompt_part(self) -> float:
        return self.span - self.decode_part

    def cost(self) -> dict[int, float]:
        """The cost split: each piece's seconds (decodes share `decode_part` equally, prompt
        pieces the rest by tokens)."""
        if self._cost is None:
            per_decode = self.decode_part / self.decodes if self.decodes else 0.0
            per_token = self.prompt_part / self.prompt_tokens if self.prompt_tokens else 0.0
            self._cost = {
                u: per_decode if it["kind"] == "decode" else per_token * piece_tokens(it)
                for u, it in self.items.items()
            }
        return self._cost

    def token_share(self) -> dict[int, float]:
        """The token split: the span by tokens, a decode counting one."""
        if self._tokens is None:
            per = self.span / (self.prompt_tokens + self.decodes)
            self._tokens = {
                u: per * (1 if it["kind"] == "decode" else piece_tokens(it))
                for u, it in self.items.items()
            }
        return self._tokens


def piece_tokens(item: Message) -> int:
    """A prompt piece's tokens (at least one, so a share is never zero)."""
    return max(1, item["end"] - item["start"])


def split_step(step: Message, prev_t1: float | None, estimate: DecodeEstimate) -> StepSplit:
    """Divide one `step` message; `prev_t1` is the previous step's `t1`."""
    t0, t1 = float(step["t0"]), float(step["t1"])
    start = t0 if prev_t1 is None or prev_t1 < t0 else prev_t1
    span = t1 - start if t1 > start else 0.0
    items: dict[int, Message] = {}
    decodes = prompt = 0
    for it in step.get("items") or ():
        if type(it) is not dict or "uid" not in it or "kind" not in it:
            continue
        items[it["uid"]] = it
        if it["kind"] == "decode":
            decodes += 1
        else:
            prompt += piece_tokens(it)
    if not prompt:
        decode_part = span
    elif not decodes:
        decode_part = 0.0
    else:
        est = estimate(decodes)
        if est is None:  # no decode-only step yet: by tokens
            est = span * decodes / (decodes + prompt)
        decode_part = min(span, est)
    retracted = step.get("retracted")
    reason = (step.get("queue") or {}).get("waiting_reason") or UNKNOWN_REASON
    return StepSplit(
        step=step.get("step", -1),
        t0=t0,
        t1=t1,
        start=start,
        span=span,
        items=items,
        decodes=decodes,
        prompt_tokens=prompt,
        decode_part=decode_part,
        retracted=frozenset(retracted) if retracted else (),
        reason=reason,
    )
