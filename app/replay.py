"""Replay a recorded run in the page, with no engine: the recording is folded into the same
`EventStore` a live connection feeds, so every view draws it through the same code path.

A recording is a JSON-lines file of protocol messages: the server's `--trace` output (a `hello`
header, then every broadcast) or the page's "Trace (JSONL)" download (the store's log, `hello`s
included). `ReplaySource` holds one, a store, and a cursor: `seek(step)` folds everything up to
and including that step's tokens and events; `play(speed)` then folds the rest as the
recording's own clock passes, 1× to 50× faster. `ReplayLink` stands where the page's
`EngineLink` stands: the same `store`, a status, and commands refused (there is no engine).
Torch-free, like the rest of the page.
"""

from __future__ import annotations

import bisect
import io
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from app.client import LinkStatus, NotConnected
from app.state import EventStore, Message
from instrumentation.trace import parse_lines as trace_lines

SPEEDS = (1, 2, 5, 10, 20, 50)  # the speeds a player offers
MIN_SPEED = float(SPEEDS[0])
MAX_SPEED = float(SPEEDS[-1])
PLAY_TICK_S = 0.05  # how often the player folds what the recording's clock has reached


def parse_lines(lines: Iterable[str]) -> Iterator[Message]:
    """Protocol messages of JSON lines (the trace reader's, keeping those with a `type`)."""
    return (m for m in trace_lines(lines) if isinstance(m.get("type"), str))


def _clock(msg: Message) -> float | None:
    """When a message happened on the engine's clock: a step when it ended (when it was
    published), an event at its `t`, a `hello` at its `now`."""
    kind = msg.get("type")
    value = msg.get("t1") if kind == "step" else msg.get("now") if kind == "hello" else msg.get("t")
    return float(value) if isinstance(value, int | float) else None


@dataclass(frozen=True)
class Recording:
    """A recorded message stream and its index: where each step message is, and each
    message's time (a message without one takes the time of the message before it)."""

    name: str
    messages: tuple[Message, ...]
    times: tuple[float, ...]
    step_at: tuple[int, ...]  # message index of each top-level step message
    step_numbers: tuple[int, ...]
    path: Path | None = None

    @classmethod
    def from_messages(
        cls, messages: Iterable[Message], name: str, path: Path | None = None
    ) -> Recording:
        msgs = tuple(messages)
        if not msgs:
            raise ValueError(f"{name}: no protocol messages in it")
        times: list[float] = []
        last = next((t for m in msgs if (t := _clock(m)) is not None), 0.0)
        step_at: list[int] = []
        numbers: list[int] = []
        for i, msg in enumerate(msgs):
            t = _clock(msg)
            last = last if t is None else max(last, t)  # a hello's `now` may trail its history
            times.append(last)
            if msg["type"] == "step" and isinstance(msg.get("step"), int):
                step_at.append(i)
                numbers.append(msg["step"])
        return cls(name, msgs, tuple(times), tuple(step_at), tuple(numbers), path)

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        path = Path(path)
        with path.open(encoding="utf-8") as f:
            return cls.from_messages(parse_lines(f), path.name, path)

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Recording:
        """An uploaded file."""
        return cls.from_messages(parse_lines(io.StringIO(data.decode("utf-8"))), name)

    @property
    def num_steps(self) -> int:
        return len(self.step_at)

    @property
    def first_step(self) -> int | None:
        return self.step_numbers[0] if self.step_numbers else None

    @property
    def last_step(self) -> int | None:
        return self.step_numbers[-1] if self.step_numbers else None

    @property
    def duration(self) -> float:
        return self.times[-1] - self.times[0]

    def end_of_step(self, step: int) -> int:
        """How many messages to fold to show `step` and what followed it: up to the next step
        message (its tokens and request events included), or everything after the last."""
        k = bisect.bisect_right(self.step_numbers, step)  # steps numbered <= step
        if k == 0:  # before the first step: the header and what came before it
            return self.step_at[0] if self.step_at else len(self.messages)
        return self.step_at[k] if k < len(self.step_at) else len(self.messages)


class ReplayStore(EventStore):
    """The page's store, which a replay can also rewind (a seek backwards)."""

    def rewind(self) -> None:
        """Forget everything, as a fresh store; views holding a cursor get a reset."""
        with self._lock:
            self._reset()  # a fresh fold: no engine facts until the recording's hello
            self._gap_pending = False
            self.restarts = 0
            self._seen = 0
            self._replies.clear()
            self._version += 1
            self._reset_version = self._version


class ReplaySource:
    """A recording, the store it is folded into, and a cursor over it. Any thread may call
    these; the player thread (`play`) calls `tick` until the end or `pause`."""

    def __init__(
        self,
        recording: Recording,
        store: ReplayStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        threaded: bool = True,
    ) -> None:
        self.recording = recording
        self.store = store or ReplayStore()
        self._clock = clock
        self._threaded = threaded
        self._lock = threading.RLock()
        self._pos = 0  # messages of the recording folded into the store
        self._speed = MIN_SPEED
        self._playing = False
        self._anchor: tuple[float, float] = (0.0, 0.0)  # (wall clock, recording time) at play
        self._thread: threading.Thread | None = None

    # ---- where the cursor is -------------------------------------------------------------

    @property
    def position(self) -> int:
        return self._pos

    @property
    def at_end(self) -> bool:
        return self._pos >= len(self.recording.messages)

    @property
    def playing(self) -> bool:
        return self._playing

    @property
    def speed(self) -> float:
        return self._speed

    @property
    def current_step(self) -> int | None:
        """The number of the last step message folded so far (None: none yet)."""
        k = bisect.bisect_left(self.recording.step_at, self._pos)  # step messages before pos
        return self.recording.step_numbers[k - 1] if k > 0 else None

    @property
    def current_time(self) -> float:
        rec = self.recording
        return rec.times[self._pos - 1] if self._pos else rec.times[0]

    # ---- moving it -----------------------------------------------------------------------

    def _fold_to(self, target: int) -> int:
        """Fold messages up to index `target` (exclusive), rewinding if it is behind."""
        target = max(0, min(target, len(self.recording.messages)))
        if target < self._pos:
            self.store.rewind()
            self._pos = 0
        msgs = self.recording.messages
        for i in range(self._pos, target):
            self.store.apply(msgs[i])
        moved = target - self._pos
        self._pos = target
        return moved

    def seek(self, step: int) -> None:
        """Show the recording as it stood when step `step` had been published (with its
        tokens and request events). Playback, if on, continues from there."""
        with self._lock:
            self._fold_to(self.recording.end_of_step(step))
            self._anchor = (self._clock(), self.current_time)

    def seek_end(self) -> None:
        with self._lock:
            self._fold_to(len(self.recording.messages))
            self._playing = False

    def set_speed(self, speed: float) -> None:
        """1× to 50× the recording's own pace; a playing replay keeps its place."""
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be within {MIN_SPEED:g}x..{MAX_SPEED:g}x, got {speed}")
        with self._lock:
            if self._playing:
                self.tick()
                self._anchor = (self._clock(), self._recording_now())
            self._speed = float(speed)

    def play(self, speed: float | None = None) -> None:
        """Fold the rest as the recording's clock passes, from the cursor on."""
        with self._lock:
            if speed is not None:
                self.set_speed(speed)
            if self.at_end:
                return
            if not self._playing:
                self._playing = True
                self._anchor = (self._clock(), self.current_time)
            if self._threaded and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._run, name=f"stepscope-replay {self.recording.name}", daemon=True
                )
                self._thread.start()

    def pause(self) -> None:
        with self._lock:
            if self._playing:
                self.tick()
            self._playing = False

    def _recording_now(self) -> float:
        wall, t = self._anchor
        return t + (self._clock() - wall) * self._speed

    def tick(self) -> int:
        """Fold every message the recording's clock has reached; returns how many."""
        with self._lock:
            if not self._playing:
                return 0
            now = self._recording_now()
            times = self.recording.times
            target = bisect.bisect_right(times, now, lo=self._pos)
            moved = self._fold_to(max(target, self._pos))
            if self.at_end:
                self._playing = False
            return moved

    def _run(self) -> None:
        while self._playing:
            self.tick()
            time.sleep(PLAY_TICK_S)


class ReplayLink:
    """What the page's views need of an engine link, over a replay: the store, a status that
    says which recording this is, and commands refused."""

    def __init__(self, source: ReplaySource) -> None:
        self.source = source
        self.store = source.store
        self.url = f"replay:{source.recording.name}"
        self.resyncs = 0
        self._since = time.monotonic()

    def status(self) -> LinkStatus:
        return LinkStatus(self.url, "connected", None, True, 0, self._since)

    def new_id(self) -> str:
        return "replay"

    def send(self, command: Message) -> str:
        raise NotConnected(
            f"replaying {self.source.recording.name}: there is no engine to send commands to"
        )

    def request(self, command: Message, timeout: float = 3.0) -> Message | None:
        self.send(command)
        return None

    def close(self) -> None:
        self.source.pause()


def open_recording(source: str | Path | IO[bytes], name: str | None = None) -> Recording:
    """A path, or an uploaded file's bytes (Streamlit's UploadedFile)."""
    if isinstance(source, str | Path):
        return Recording.load(source)
    data: Any = source.read()
    return Recording.from_bytes(data, name or getattr(source, "name", "upload.jsonl"))
