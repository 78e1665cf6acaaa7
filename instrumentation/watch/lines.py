"""Lines of a log: a whole file, standard input, or a file that keeps growing (`--follow`).

Following polls the file: at its end it waits, keeps a partial last line until its newline
arrives, starts over when the file is truncated, and reopens it when it is replaced (log
rotation). Bytes that are not UTF-8 are replaced, never fatal.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import IO

POLL_S = 0.2


def read_lines(
    path: str, *, follow: bool = False, stop: threading.Event | None = None
) -> Iterator[str]:
    stop = stop or threading.Event()
    if path == "-":
        for line in sys.stdin:
            if stop.is_set():
                return
            yield line
        return
    f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - reopened on rotation
    try:
        if not follow:
            yield from f
            return
        yield from _follow(path, f, stop)
    finally:
        f.close()


def _follow(path: str, f: IO[str], stop: threading.Event) -> Iterator[str]:
    partial = ""
    inode = os.fstat(f.fileno()).st_ino
    while not stop.is_set():
        chunk = f.readline()
        if chunk:
            partial += chunk
            if partial.endswith("\n"):
                yield partial
                partial = ""
            continue
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
