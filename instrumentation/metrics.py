"""Per-request latency metrics, named as vLLM and SGLang name them.

- queue_time_seconds: queued until admitted (first scheduled).
- time_to_first_token_seconds (TTFT): queued until the first output token.
- inter_token_latency_seconds (ITL): the gaps between consecutive output tokens.
- time_per_output_token_seconds (TPOT): (last token - first token) / (output tokens - 1).
- e2e_request_latency_seconds: queued until the last output token.
- max_stall_seconds: the longest ITL, i.e. the worst wait for a next token.
"""

from __future__ import annotations

from typing import Any


def request_metrics(
    t_queued: float, t_admitted: float | None, token_times: list[float]
) -> dict[str, Any]:
    itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    first = token_times[0] if token_times else None
    last = token_times[-1] if token_times else None
    return {
        "queue_time_seconds": None if t_admitted is None else t_admitted - t_queued,
        "time_to_first_token_seconds": None if first is None else first - t_queued,
        "inter_token_latency_seconds": itl,
        "time_per_output_token_seconds": (last - first) / len(itl) if itl else None,  # type: ignore[operator]
        "e2e_request_latency_seconds": None if last is None else last - t_queued,
        "max_stall_seconds": max(itl) if itl else None,
    }


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
