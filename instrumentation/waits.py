"""A request's waits in detail: the wait before each of its tokens, by cause and by step.

`GapDelay` is the wait before one token (index 0: from queued to the first token), made of
`Charge`s: seconds charged to one cause (a Delay part; for `by` another request and its work;
for `queue` the waiting reason) over a run of consecutive steps. The delay's ledger
(instrumentation.delay) builds them with `delays=True` on the fold; the page describes them:
"38 ms: 31 ms request 9's prompt [512:768] in steps 812–814, 7 ms own decode in step 815".
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Charge", "GapDelay", "describe_seconds"]

# a cause: (part, waiting reason, other request's uid, work: prompt / recompute / decode)
Key = tuple[str, str | None, int | None, str | None]
HOST: Key = ("host", None, None, None)
OWN_DECODE: Key = ("own", None, None, "decode")


def describe_seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


@dataclass(frozen=True, slots=True)
class Charge:
    """Seconds of one request's wait charged to one cause over `steps` steps in
    `first_step` .. `last_step`. `part` is a Delay part; `reason` the waiting reason (queue),
    `uid` the other request (by), `kind` the work (`prompt`, `recompute`, `decode`) and
    `start`:`end` its token range, where the work was a prompt or a recompute."""

    part: str
    seconds: float
    first_step: int
    last_step: int
    steps: int
    reason: str | None = None
    uid: int | None = None
    kind: str | None = None
    start: int | None = None
    end: int | None = None

    def what(self) -> str:
        """The cause in words: "request 9's prompt [512:768]", "own decode", "waiting (kv)"."""
        span = f" [{self.start}:{self.end}]" if self.start is not None else ""
        if self.part == "by":
            return f"request {self.uid}'s {self.kind}{span}"
        if self.part == "queue":
            return f"waiting ({self.reason})"
        if self.part == "host":
            return "between steps"
        if self.part == "retracted":
            return f"own recompute{span}"
        return f"own {self.kind}{span}"

    def describe(self) -> str:
        """E.g. "31 ms request 9's prompt [512:768] in steps 812–814"."""
        if self.first_step == self.last_step:
            steps = f"step {self.first_step}"
        elif self.steps == self.last_step - self.first_step + 1:
            steps = f"steps {self.first_step}–{self.last_step}"
        else:
            steps = f"{self.steps} steps in {self.first_step}–{self.last_step}"
        return f"{describe_seconds(self.seconds)} {self.what()} in {steps}"


@dataclass(frozen=True, slots=True)
class GapDelay:
    """The wait before one of a request's tokens (`index` 0: queued to its first token), by
    cause. `stall`: a step ran without it in between (instrumentation.metrics); `ongoing`: no
    token ended it (the request is still waiting, or ended without it)."""

    uid: int
    index: int
    t_start: float
    t_end: float
    first_step: int | None
    last_step: int | None
    stall: bool
    ongoing: bool
    charges: tuple[Charge, ...]

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start

    @property
    def waited(self) -> float:
        """Of it, the seconds spent waiting for admission."""
        return sum(c.seconds for c in self.charges if c.part == "queue")

    def causes(self) -> list[Charge]:
        """One Charge per cause (its runs added up), largest first."""
        runs: dict[tuple, list[Charge]] = {}
        for c in self.charges:
            runs.setdefault((c.part, c.reason, c.uid, c.kind), []).append(c)
        return sorted((_merged(rs) for rs in runs.values()), key=lambda c: -c.seconds)

    def main(self) -> Charge | None:
        """The largest cause, every run of it added up."""
        causes = self.causes()
        return causes[0] if causes else None

    def describe(self) -> str:
        """E.g. "38 ms: 31 ms request 9's prompt [512:768] in steps 812–814, 7 ms own decode
        in step 815"."""
        parts = sorted(self.charges, key=lambda c: -c.seconds)
        text = ", ".join(c.describe() for c in parts if c.seconds > 0) or "nothing"
        return f"{describe_seconds(self.seconds)}: {text}"


def _merged(runs: list[Charge]) -> Charge:
    c = runs[0]
    starts = [r.start for r in runs if r.start is not None]
    ends = [r.end for r in runs if r.end is not None]
    return Charge(
        c.part, sum(r.seconds for r in runs), min(r.first_step for r in runs),
        max(r.last_step for r in runs), sum(r.steps for r in runs), c.reason, c.uid, c.kind,
        min(starts) if starts else None, max(ends) if ends else None,
    )  # fmt: skip


class Run:
    """A Charge being built: extended while its cause recurs in consecutive steps."""

    __slots__ = ("key", "seconds", "first", "last", "steps", "start", "end")

    def __init__(self, key: Key, step: int, seconds: float, start: int | None,
                 end: int | None) -> None:  # fmt: skip
        self.key, self.seconds, self.first, self.last, self.steps = key, seconds, step, step, 1
        self.start, self.end = start, end

    def charge(self) -> Charge:
        part, reason, uid, kind = self.key
        return Charge(part, self.seconds, self.first, self.last, self.steps, reason, uid, kind,
                      self.start, self.end)  # fmt: skip


class WaitLog:
    """One request's waits as the ledger charges them: the runs of the current wait, and each
    closed wait kept as its raw runs (made into a `GapDelay` only when asked for: most are one
    run of its own decode, and a page asks for few)."""

    __slots__ = ("uid", "runs", "open", "closed")

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.runs: list[Run] = []
        self.open: dict[Key, Run] = {}
        # (t_start, t_end, first step, last step, stall, ongoing, runs)
        self.closed: list[tuple] = []

    def note(self, key: Key, step: int, seconds: float, start: int | None = None,
             end: int | None = None) -> None:  # fmt: skip
        """`seconds` of the current wait went to `key` in `step`."""
        run = self.open.get(key)
        if run is not None and run.last >= step - 1:
            run.seconds += seconds
            if run.last != step:
                run.steps += 1
                run.last = step
            if start is not None:
                run.start = start if run.start is None else min(run.start, start)
                run.end = end if run.end is None else max(run.end, end)  # type: ignore[type-var]
            return
        run = self.open[key] = Run(key, step, seconds, start, end)
        self.runs.append(run)

    def close(self, t_start: float, t_end: float, step: int | None, stall: bool,
              ongoing: bool = False) -> None:  # fmt: skip
        first = self.runs[0].first if self.runs else None
        self.closed.append((t_start, t_end, first, step, stall, ongoing, self.runs))
        self.runs, self.open = [], {}

    def gaps(self, current: tuple | None = None) -> list[GapDelay]:
        """Every closed wait, then `current` (t_start, t_end, step) as an ongoing one."""
        rows = list(self.closed)
        if current is not None and self.runs:
            rows.append((current[0], current[1], self.runs[0].first, current[2], False, True,
                         self.runs))  # fmt: skip
        return [
            GapDelay(
                self.uid, i, a, b, first, last, stall, ongoing, tuple(r.charge() for r in runs)
            )  # fmt: skip
            for i, (a, b, first, last, stall, ongoing, runs) in enumerate(rows)
        ]
