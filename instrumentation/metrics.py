"""Per-request latency metrics, named as vLLM and SGLang name them.

- queue_time_seconds: queued until admitted (first scheduled).
- time_to_first_token_seconds (TTFT): queued until the first output token.
- inter_token_latency_seconds (ITL): the gaps between consecutive output tokens.
- time_per_output_token_seconds (TPOT): (last token - first token) / (output tokens - 1).
- e2e_request_latency_seconds: queued until the last output token.
- prefill_time_seconds: admitted until the first output token (vLLM's request_prefill_time).
- decode_time_seconds: first output token until the last (vLLM's request_decode_time).
- inference_time_seconds: admitted until the last output token (vLLM's
  request_inference_time).
- max_stall_seconds: the longest *stall* (docs/protocol.md): a gap between two of the request's
  tokens during which at least one step ran without it. `stalled_between` is that rule, once.
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
        "prefill_time_seconds": None if first is None or t_admitted is None else first - t_admitted,
        "decode_time_seconds": None if first is None else last - first,  # type: ignore[operator]
        "inference_time_seconds": (
            None if last is None or t_admitted is None else last - t_admitted
        ),
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


def stalled_between(step_a: int, step_b: int) -> bool:
    """The protocol's stall rule: a request that sampled tokens in steps numbered `step_a` and
    `step_b` (step_a < step_b) stalled between them iff a step ran in between without it."""
    return step_b - step_a > 1


def max_stall(token_times: list[float], token_steps: list[int]) -> float | None:
    """The longest stall of one request: its tokens' times and the numbers of the steps that
    sampled them (same length); None when it never stalled."""
    worst: float | None = None
    for i in range(1, min(len(token_times), len(token_steps))):
        if stalled_between(token_steps[i - 1], token_steps[i]):
            gap = token_times[i] - token_times[i - 1]
            worst = gap if worst is None or gap > worst else worst
    return worst
