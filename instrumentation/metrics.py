"""Request metrics, defined once (docs/protocol.md, "Metrics"). Every figure the project shows
comes from these functions: `finished` events, `generate()`, the fold and its `Summary` (the
page's headline, replay compare, the sweep), `/metrics`, the trace export and the benchmarks
(bench/).

Named as vLLM and SGLang name them:
- queue_time_seconds: queued until admitted (first scheduled).
- time_to_first_token_seconds (TTFT): queued until the first output token.
- inter_token_latency_seconds (ITL): the gaps between consecutive output tokens.
- time_per_output_token_seconds (TPOT): (last token - first token) / (output tokens - 1).
- e2e_request_latency_seconds: queued until the last output token.
- prefill_time_seconds: admitted until the first output token (vLLM's request_prefill_time).
- decode_time_seconds: the first output token until the last (vLLM's request_decode_time).
- inference_time_seconds: admitted until the last output token (vLLM's
  request_inference_time).
- max_itl_seconds: the longest inter-token gap, whatever caused it.
- max_stall_seconds: the longest *stall*: a gap between two of the request's tokens during which
  at least one engine step ran without it (`stalled_between`). A slow step that included the
  request makes a long gap, not a stall. None when the request never stalled.

A token's time is the `t1` of the step that sampled it, and its step is that step's number.
Pure Python: no torch, nothing from the engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "ITL_QUANTILES",
    "gaps",
    "max_stall",
    "percentile",
    "request_metrics",
    "stall_gaps",
    "stalled_between",
]

# the ITL percentiles every headline shows: the median, the tail and the tail's tail (pooled ITL
# p99 can hide stalls that p99.9 and the worst stall show)
ITL_QUANTILES: tuple[float, ...] = (50, 99, 99.9)


def stalled_between(step_a: int, step_b: int) -> bool:
    """The protocol's stall rule: a request that sampled tokens in steps numbered `step_a` and
    `step_b` (step_a < step_b) stalled between them iff a step ran in between without it."""
    return step_b - step_a > 1


def gaps(token_times: Sequence[float]) -> list[float]:
    """Inter-token latencies: the gap before each token but the first."""
    return [b - a for a, b in zip(token_times, token_times[1:], strict=False)]


def stall_gaps(token_times: Sequence[float], token_steps: Sequence[int]) -> Iterator[float]:
    """The gaps that are stalls, in order: `token_times[i]` was sampled in step
    `token_steps[i]` (the two lists are the same length)."""
    if len(token_times) != len(token_steps):
        raise ValueError(
            f"{len(token_times)} token times but {len(token_steps)} token steps: a stall needs both"
        )
    for i in range(1, len(token_times)):
        if stalled_between(token_steps[i - 1], token_steps[i]):
            yield token_times[i] - token_times[i - 1]


def max_stall(token_times: Sequence[float], token_steps: Sequence[int]) -> float | None:
    """The longest stall of one request (see `stall_gaps`); None when it never stalled."""
    return max(stall_gaps(token_times, token_steps), default=None)


def request_metrics(
    t_queued: float,
    t_admitted: float | None,
    token_times: Sequence[float],
    token_steps: Sequence[int] | None,
) -> dict[str, Any]:
    """One request's figures from its queue and admission times and its tokens' times and step
    numbers; None where a figure is undefined (TPOT with one token, no stall, ...). A client that
    sees the tokens but not the steps passes `token_steps=None`: it cannot tell a stall from a
    slow step, so `max_stall_seconds` is left out rather than reported as none."""
    itl = gaps(token_times)
    first = token_times[0] if token_times else None
    last = token_times[-1] if token_times else None
    out = {
        "queue_time_seconds": None if t_admitted is None else t_admitted - t_queued,
        "time_to_first_token_seconds": None if first is None else first - t_queued,
        "inter_token_latency_seconds": itl,
        "time_per_output_token_seconds": (last - first) / len(itl) if itl else None,  # type: ignore[operator]
        "e2e_request_latency_seconds": None if last is None else last - t_queued,
        "prefill_time_seconds": None if first is None or t_admitted is None else first - t_admitted,
        "decode_time_seconds": None if first is None else last - first,  # type: ignore[operator]
        "inference_time_seconds": (
            None if last is None or t_admitted is None else last - t_admitted
        ),
        "max_itl_seconds": max(itl) if itl else None,
    }
    if token_steps is not None:
        out["max_stall_seconds"] = max_stall(token_times, token_steps)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
