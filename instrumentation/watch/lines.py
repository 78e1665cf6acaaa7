"""Lines of a log: a whole file, standard input, or a file that keeps growing (`--follow`).

Following polls the file: at its end it waits, keeps a partial last line until its newline
arrives, starts over when the file is truncated, and reopens it when it is replaced (log
rotation). Bytes that are not UTF-8 are replaced, never fatal. With `idle_s`, a follow (or
standard input) yields None once the input has been quiet that long, so a reader can place the
steps it holds (placement.py) without waiting for the next line.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

POLL_S = 0.2


def read_lines(
    path: str,
    *,
    follow: bool = False,
    stop: threading.Event | None = None,
    idle_s: float | None = None,
) -> Iterator[str | None]:
    stop = stop or threading.Event()
    if path == "-":
        yield from _stdin(stop, idle_s)
        return
    f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - reopened on rotation
    try:
        if not follow:
            yield from f
            return
        yield from _follow(path, f, stop, idle_s)
    finally:
        f.close()


def _stdin(stop: threading.Event, idle_s: float | None) -> Iterator[str | None]:
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError):  # not a file (a test's StringIO): read it as it comes
        fd = None
    if idle_s is None or fd is None or not hasattr(select, "poll"):
        for line in sys.stdin:
            if stop.is_set():
                return
            yield line
        return
    # Unbuffered reads, so a poll of the file descriptor sees every line that has arrived.
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    pending, quiet = b"", False
    while not stop.is_set():
        if not poller.poll(int(idle_s * 1000)):
            if not quiet:
                quiet = True
                yield None
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        quiet = False
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace") + "\n"
    if pending:
        yield pending.decode("utf-8", errors="replace")


def _follow(
    path: str, f: IO[str], stop: threading.Event, idle_s: float | None
) -> Iterator[str | None]:
    partial = ""
    inode = os.fstat(f.fileno()).st_ino
    last_line = time.monotonic()
    quiet = False
    while not stop.is_set():
        chunk = f.readline()
        if chunk:
            partial += chunk
            if partial.endswith("\n"):
                yield partial
                partial = ""
                last_line, quiet = time.monotonic(), False
            continue
        if idle_s is not None and not quiet and time.monotonic() - last_line >= idle_s:
            quiet = True
            yield None
        # At the end: wait for more, or notice truncation and rotation.
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and st.st_ino != inode:
            f.close()
            f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
            inode, partial = st.st_ino, ""
            continue
        if st is not None and st.st_size < f.tell():
            f.seek(0)
            partial = ""
            continue
        stop.wait(POLL_S)
    f.close()
