"""A fleet's headline: several engines' whole recordings summarized as one.

The fleet replay's last summary row and its comparison of two fleet recordings (app/fleet_replay.py)
read it. It is `instrumentation.fold`'s one computation of the headline (`_summary`) over every
engine's requests, each engine folded on its own as `fold.summarize` folds a recording. Pure
Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from instrumentation.fold import Fold, Summary, _summary
from instrumentation.request_record import RequestRecord

Message = dict[str, Any]


def summarize_fleet(recordings: Sequence[tuple[Iterable[Message], float]]) -> Summary:
    """Several engines' whole recordings as one fleet, each given with its offset onto the
    fleet's one clock (its `clock_epoch` minus the fleet's). Each is folded on its own (uids,
    `seq` and instances are per engine); their requests and tokens are pooled, and the span runs
    from the earliest first step to the latest last step on the fleet's clock. A request's
    figures (TTFT, ITL, stalls) are differences of its own engine's times: the offsets move only
    the span. `steps` counts every engine's steps; step numbers, each engine's own, are left
    out, and `worst_stall_uid` is a uid on its own engine."""
    recs: list[RequestRecord] = []
    prompt_tokens = output_tokens = num_steps = 0
    starts: list[float] = []
    ends: list[float] = []
    for messages, offset in recordings:
        fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62)  # as summarize
        for msg in messages:
            fold.apply(msg)
        recs.extend(fold.requests())
        prompt_tokens += fold.prompt_tokens
        output_tokens += fold.output_tokens
        num_steps += fold.num_steps
        if fold._first_t0 is not None and fold._last_t1 is not None:
            starts.append(fold._first_t0 + offset)
            ends.append(fold._last_t1 + offset)
    return _summary(
        recs,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        span=max(ends) - min(starts) if starts else None,
        steps=(num_steps, None, None),
    )
