"""Step times from logs whose stamps have whole-second resolution.

vLLM's default log format (`%m-%d %H:%M:%S`) and SGLang's (`%Y-%m-%d %H:%M:%S`) stamp lines to
the second, while an engine runs tens of steps a second: taken as they are, many steps would share
one instant. A line with a finer stamp (`.123`) is placed at its stamp (`t_source: "log"`). A
line stamped to the second is held until the log has moved past that second (a later stamp, the
end of the input, or a quiet spell while following), then the steps of that second are laid out
inside it: in log order, each lasting its reported elapsed time, with equal gaps between them,
never two at one time, and marked `t_source: "estimated"`. Each stream (a data-parallel rank:
each has its own engine loop) is placed on its own.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from instrumentation.watch.aggregate import AggregateStep

EDGE_S = 0.001  # a placed step ends at least this far inside its second
LATE_GAP_S = 0.001  # a line for a second already placed goes just after the last placed step


@dataclass
class _Stream:
    second: float | None = None  # the second whose steps are held
    held: list[tuple[AggregateStep, float]] = field(default_factory=list)  # (step, duration)
    last_t1: float | None = None  # the last placed step's end


@dataclass
class StepPlacer:
    """Feed steps whose `t1` is their line's stamp (seconds on the log clock); get them back with
    honest times, in the order they are final."""

    streams: dict[Hashable, _Stream] = field(default_factory=dict)

    def add(
        self, key: Hashable, step: AggregateStep, *, coarse: bool, duration: float = 0.0
    ) -> list[AggregateStep]:
        """A step read from a line. `coarse`: the stamp has whole-second resolution; `duration`:
        what the line says the step lasted (0 when it says nothing)."""
        stream = self.streams.setdefault(key, _Stream())
        if not coarse or step.t_source != "log":
            out = self._release(stream)
            stream.last_t1 = max(stream.last_t1 or step.t1, step.t1)
            return [*out, step]
        if stream.second != step.t1 and stream.last_t1 is not None and stream.last_t1 >= step.t1:
            # A line for a second already placed (or older than the one held): just after the
            # last placed step.
            return [self._late(stream, step, duration)]
        out: list[AggregateStep] = []
        if stream.second is not None and step.t1 > stream.second:
            out = self._release(stream)
        stream.second = step.t1
        stream.held.append((step, max(0.0, duration)))
        return out

    def advance(self, stamp: float) -> list[AggregateStep]:
        """The log reached `stamp` (any line's, in seconds): seconds before it are over."""
        out: list[AggregateStep] = []
        for stream in self.streams.values():
            if stream.second is not None and stamp >= stream.second + 1.0:
                out.extend(self._release(stream))
        return out

    def flush(self) -> list[AggregateStep]:
        """The end of the input, or no line for a while: place whatever is held."""
        out: list[AggregateStep] = []
        for stream in self.streams.values():
            out.extend(self._release(stream))
        return out

    @property
    def holding(self) -> int:
        return sum(len(s.held) for s in self.streams.values())

    def _release(self, stream: _Stream) -> list[AggregateStep]:
        if not stream.held or stream.second is None:
            return []
        placed = spread(stream.second, stream.held, stream.last_t1)
        stream.held, stream.second = [], None
        stream.last_t1 = placed[-1].t1
        return placed

    def _late(self, stream: _Stream, step: AggregateStep, duration: float) -> AggregateStep:
        prev = stream.last_t1
        assert prev is not None
        t1 = prev + max(duration, LATE_GAP_S)
        stream.last_t1 = t1
        return replace(step, t0=max(prev, t1 - duration), t1=t1, t_source="estimated")


def spread(
    second: float, held: list[tuple[AggregateStep, float]], after: float | None = None
) -> list[AggregateStep]:
    """Lay out the steps stamped `second` inside [second, second + 1): in order, each ending its
    reported duration after the previous one ended plus an equal gap, the gaps sharing what the
    durations leave of the second (so one step sits mid-second). When the durations add up to
    more than the second, they are scaled down to fit and each step starts where the previous
    ended. `after`: the end of the stream's previous step, which no step may start before."""
    window = 1.0 - EDGE_S
    durations = [d for _, d in held]
    between = sum(durations[1:])  # what must fit between the first and the last end
    if between <= window:
        gap, scale = (window - between) / (len(held) + 1), 1.0
    else:
        gap, scale = 0.0, window / between
    out: list[AggregateStep] = []
    t1 = second
    prev_end = after
    for i, (step, d) in enumerate(held):
        t1 = second + gap if i == 0 else t1 + gap + d * scale
        t0 = t1 - d
        if prev_end is not None:
            t0 = max(t0, prev_end)  # never overlap the step before
        out.append(replace(step, t0=min(t0, t1), t1=t1, t_source="estimated"))
        prev_end = t1
    return out
