"""Raw ZMQ messages on disk: record what an engine published, replay it without the engine.

`--record-frames FILE` keeps every multipart message the watch receives on its KV-event socket,
byte for byte, with when it arrived; a `--kv-events FILE` (a path instead of an endpoint) reads
such a file back. The format is a header line, then per message: its arrival (seconds since the
first, float64), its frame count (uint32), and each frame as a uint32 length and the bytes, all
big-endian. A file cut short (a recorder killed mid-write) reads up to its last whole message.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from instrumentation.watch.zmq_sub import Frames

MAGIC = b"stepscope-zmq-frames 1\n"


class FrameRecorder:
    def __init__(self, path: str | Path) -> None:
        self._file: BinaryIO = Path(path).open("wb")
        self._file.write(MAGIC)
        self._file.flush()
        self._t0: float | None = None
        self.messages = 0

    def write(self, frames: Frames, at: float | None = None) -> None:
        now = time.monotonic() if at is None else at
        if self._t0 is None:
            self._t0 = now
        parts = [struct.pack(">dI", now - self._t0, len(frames))]
        for frame in frames:
            parts += [struct.pack(">I", len(frame)), bytes(frame)]
        self._file.write(b"".join(parts))
        self._file.flush()  # a recorder stopped at any moment keeps what it received
        self.messages += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_frames(path: str | Path) -> Iterator[tuple[float, Frames]]:
    """(arrival in seconds since the first, frames) of each recorded message."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a frames file (no '{MAGIC.decode().strip()}' header)")
    pos = len(MAGIC)
    while pos + 12 <= len(data):
        at, count = struct.unpack_from(">dI", data, pos)
        pos += 12
        frames: Frames = []
        for _ in range(count):
            if pos + 4 > len(data):
                return
            (size,) = struct.unpack_from(">I", data, pos)
            pos += 4
            if pos + size > len(data):
                return
            frames.append(data[pos : pos + size])
            pos += size
        yield at, frames


def is_frames_file(target: str) -> bool:
    """A `--kv-events` target that is a recorded file, not a ZMQ endpoint."""
    return "://" not in target and Path(target).is_file()
