"""A fleet recording, replayed: one trace per replica, all on one clock.

`python -m engine.server.fleet --trace-dir DIR` has each replica write its `--trace` to
DIR/replica-<i>.jsonl: a `hello` header (its `engine.clock_epoch` is the wall-clock time at which
that engine's clock read 0), then every message. `FleetRecording` loads such a folder, each
trace an app/replay.py `Recording`, with each replica's offset onto the fleet's clock (its epoch
minus the earliest). `FleetReplay` folds each one through its own `ReplaySource` (the page draws
each through a `ReplayLink`, as it draws one recording) and moves them together: a position is
a time on the fleet's clock, and each replica shows what it had published by then. Its figures
come from the shared fold: `summarize` per replica, `summarize_fleet` for the fleet, and
`compare_rows` sets two fleet recordings (e.g. one workload under two gateway policies) side by
side. Torch-free and Streamlit-free, like app/replay.py.
"""

from __future__ import annotations

import bisect
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from app.replay import MAX_SPEED, MIN_SPEED, PLAY_TICK_S, Recording, ReplayLink, ReplaySource
from instrumentation.fleet import summarize_fleet
from instrumentation.fold import Summary, summarize

TRACE_RE = re.compile(r"replica-(\d+)\.jsonl")  # engine.server.fleet's TRACE_NAME
# (label, Summary field): the figures of the comparison table, in order
FIGURES: tuple[tuple[str, str], ...] = (
    ("requests", "requests"),
    ("output tok/s", "output_tok_s"),
    ("prefix-cache hit rate", "prefix_hit_rate"),
    ("TTFT p50 (s)", "ttft_p50_s"),
    ("ITL p99 (s)", "itl_p99_s"),
    ("worst stall (s)", "worst_stall_s"),
)
FLEET = "fleet"  # the comparison's row of the whole fleet


def trace_dir_from(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """`streamlit run app/main.py -- --fleet-trace DIR`, else STEPSCOPE_FLEET_TRACE."""
    for i, arg in enumerate(argv):
        if arg == "--fleet-trace" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--fleet-trace="):
            return arg.split("=", 1)[1]
    return env.get("STEPSCOPE_FLEET_TRACE") or None


def replica_files(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The folder's replica traces by replica number; ValueError saying what is wrong."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a folder (a fleet recording is a folder of replica-<i>.jsonl, "
            "from python -m engine.server.fleet --trace-dir)"
        )
    found = sorted(
        (int(m.group(1)), p) for p in path.iterdir() if (m := TRACE_RE.fullmatch(p.name))
    )
    if not found:
        raise ValueError(f"{path} holds no replica-<i>.jsonl (python -m engine.server.fleet "
                         "--trace-dir writes them)")  # fmt: skip
    return found


def engine_of(recording: Recording) -> dict[str, Any]:
    """The engine facts of the recording's first `hello` ({} if it has none)."""
    hello = next((m for m in recording.messages if m.get("type") == "hello"), None)
    engine = (hello or {}).get("engine")
    return engine if isinstance(engine, dict) else {}


def clock_offsets(engines: Sequence[Mapping[str, Any] | None]) -> list[float]:
    """Each engine's shift onto the earliest engine's clock (0 where an engine has no epoch)."""
    epochs = [(e or {}).get("clock_epoch") for e in engines]
    known = [float(x) for x in epochs if x is not None]
    base = min(known) if known else 0.0
    return [0.0 if x is None else float(x) - base for x in epochs]


@dataclass(frozen=True)
class FleetRecording:
    """A folder of replica traces, loaded, with each one's offset onto the fleet's clock."""

    folder: Path
    numbers: tuple[int, ...]  # the replica number of each trace (replica-<i>.jsonl)
    recordings: tuple[Recording, ...]
    offsets: tuple[float, ...]
    aligned: bool  # every trace's hello carried clock_epoch (else the unknown ones are at 0)

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> FleetRecording:
        files = replica_files(folder)
        recordings = []
        for _, path in files:
            try:
                recordings.append(Recording.load(path))
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: {exc}") from None
        engines = [engine_of(r) for r in recordings]
        return cls(
            Path(folder).expanduser(),
            tuple(i for i, _ in files),
            tuple(recordings),
            tuple(clock_offsets(engines)),
            all(e.get("clock_epoch") is not None for e in engines),
        )

    @property
    def names(self) -> list[str]:
        return [f"replica {i}" for i in self.numbers]

    @property
    def start(self) -> float:
        """The fleet clock's first step (a trace without steps: its first message)."""
        firsts = []
        for r, off in zip(self.recordings, self.offsets, strict=True):
            t0 = r.messages[r.step_at[0]].get("t0") if r.step_at else None
            firsts.append((float(t0) if isinstance(t0, int | float) else r.times[0]) + off)
        return min(firsts)

    @property
    def end(self) -> float:
        return max(r.times[-1] + off for r, off in zip(self.recordings, self.offsets, strict=True))

    @cached_property
    def summaries(self) -> list[Summary]:
        """Each replica's whole recording, by the shared fold."""
        return [summarize(r.messages) for r in self.recordings]

    @cached_property
    def total(self) -> Summary:
        """The whole fleet's recording as one, by the shared fold."""
        return summarize_fleet(
            [(r.messages, off) for r, off in zip(self.recordings, self.offsets, strict=True)]
        )


class FleetReplay:
    """Every replica's `ReplaySource`, moved together along the fleet's clock. `generation`
    grows whenever the position moves other than by the page's own scrubber, so a page can
    redraw its scrubber at the new place."""

    def __init__(
        self, fleet: FleetRecording, clock: Callable[[], float] = time.monotonic,
        threaded: bool = True,
    ) -> None:  # fmt: skip
        self.fleet = fleet
        self.sources = [ReplaySource(r, threaded=False) for r in fleet.recordings]
        self.links = [ReplayLink(s) for s in self.sources]
        # each trace's step messages' times (when each was published), on its own clock
        self._step_times = [[r.times[i] for i in r.step_at] for r in fleet.recordings]
        self._clock = clock
        self._threaded = threaded
        self._lock = threading.RLock()
        self._speed = MIN_SPEED
        self._playing = False
        self._anchor = (0.0, 0.0)  # (wall clock, fleet time) when play began
        self._thread: threading.Thread | None = None
        self.generation = 0
        self.position = fleet.end
        self._fold(self.position)

    @property
    def playing(self) -> bool:
        return self._playing

    @property
    def speed(self) -> float:
        return self._speed

    @property
    def at_end(self) -> bool:
        return self.position >= self.fleet.end

    def _fold(self, t: float) -> None:
        """Each replica as it stood at fleet time `t`: its steps published by then, each with
        its tokens and request events (a trace is folded step by step, as app/replay.py does)."""
        for src, off, times in zip(self.sources, self.fleet.offsets, self._step_times,
                                   strict=True):  # fmt: skip
            rec, local = src.recording, t - off
            if local >= rec.times[-1] or not times:
                src.seek_end()
                continue
            k = bisect.bisect_right(times, local)  # this trace's steps published by then
            first = rec.first_step if rec.first_step is not None else 0
            src.seek(rec.step_numbers[k - 1] if k else first - 1)

    def seek(self, t: float, moved_here: bool = False) -> None:
        """Show the fleet at fleet time `t` (clamped to the recording). `moved_here`: the caller
        is the scrubber already showing `t` (the generation stays)."""
        with self._lock:
            self.position = min(max(float(t), self.fleet.start), self.fleet.end)
            self._fold(self.position)
            self._anchor = (self._clock(), self.position)
            if not moved_here:
                self.generation += 1

    def set_speed(self, speed: float) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be within {MIN_SPEED:g}x..{MAX_SPEED:g}x, got {speed}")
        with self._lock:
            if self._playing:
                self.tick()
                self._anchor = (self._clock(), self.position)
            self._speed = float(speed)

    def play(self, speed: float | None = None) -> None:
        """Every replica moves on together at `speed` times the recording's pace; from the
        start if at the end."""
        with self._lock:
            if speed is not None:
                self.set_speed(speed)
            if self.at_end:
                self.seek(self.fleet.start)
            self._playing = True
            self._anchor = (self._clock(), self.position)
            self.generation += 1
            if self._threaded and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._run, name=f"stepscope-fleet-replay {self.fleet.folder.name}",
                    daemon=True,
                )  # fmt: skip
                self._thread.start()

    def pause(self) -> None:
        with self._lock:
            if self._playing:
                self.tick()
                self._playing = False
                self.generation += 1

    def tick(self) -> None:
        """Fold what the fleet's clock has reached since play began."""
        with self._lock:
            if not self._playing:
                return
            wall, t = self._anchor
            self.position = min(t + (self._clock() - wall) * self._speed, self.fleet.end)
            self._fold(self.position)
            if self.at_end:
                self._playing = False
                self.generation += 1

    def _run(self) -> None:
        while self._playing:
            self.tick()
            time.sleep(PLAY_TICK_S)

    def close(self) -> None:
        self.pause()


def _delta(a: Any, b: Any) -> Any:
    return b - a if isinstance(a, int | float) and isinstance(b, int | float) else None


def compare_rows(a: FleetRecording, b: FleetRecording) -> list[dict[str, Any]]:
    """Per replica (by replica number) and for the whole fleet, each figure of A and of B and
    B − A; every figure is the shared fold's (`FleetRecording.summaries` and `.total`)."""
    sides: list[tuple[str, Summary | None, Summary | None]] = []
    by_a = dict(zip(a.numbers, a.summaries, strict=True))
    by_b = dict(zip(b.numbers, b.summaries, strict=True))
    for i in sorted(set(by_a) | set(by_b)):
        sides.append((f"replica {i}", by_a.get(i), by_b.get(i)))
    sides.append((FLEET, a.total, b.total))
    rows = []
    for who, sa, sb in sides:
        for label, name in FIGURES:
            va = None if sa is None else getattr(sa, name)
            vb = None if sb is None else getattr(sb, name)
            rows.append(
                {"replica": who, "figure": label, "A": va, "B": vb, "B − A": _delta(va, vb)}
            )
    return rows
