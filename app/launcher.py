"""Starting `python -m engine.server` as a subprocess when nothing answers at a local URL.

The app never imports the engine: it runs it as another process and reads its output lines,
which is how the page shows model loading (and why the engine died, if it does).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

PROJECT_ROOT = Path(__file__).resolve().parent.parent
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_PROGRESS = re.compile(r"^(?P<label>[^:|]*?):?\s*(?P<pct>\d{1,3})%\|")
_PR_SET_PDEATHSIG = 1


def local_port(url: str) -> int | None:
    """The port of a ws:// URL on this machine, or None if the URL points elsewhere."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or parts.hostname not in LOCAL_HOSTS:
        return None
    return parts.port or (443 if parts.scheme == "wss" else 80)


def engine_argv(port: int, model: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The command that starts an engine for the page. Its OpenAI API listens on a free port
    unless the user's arguments name one: a fixed default (8000, vLLM's too) is often taken by
    another server or a second page, and the page itself needs no HTTP port."""
    http = () if any(a.split("=")[0] == "--http-port" for a in extra) else ("--http-port", "0")
    return [
        sys.executable,
        "-m",
        "engine.server",
        "--port",
        str(port),
        "--model",
        model,
        "--device",
        "auto",  # CUDA when there is a GPU: the engine picks where it is fastest
        *http,
        *extra,
    ]


_TAKEN = re.compile(r"cannot listen on (?P<where>\S+?):(?P<port>\d+)")


def port_taken(lines: list[str]) -> str | None:
    """What to do when the engine died because a port it was told to use is taken (from its
    last output), or None when that is not why it died."""
    for line in reversed(lines):
        if (m := _TAKEN.search(line)) is not None:
            where, port = m.group("where"), m.group("port")
            return (
                f"Port {port} on {where} is taken by another program (another engine, vLLM, "
                "or a second page). Stop that program, or pick another port: "
                "`STEPSCOPE_ENGINE_ARGS='--http-port 0'` lets the OpenAI API take any free "
                "port, and `STEPSCOPE_URL=ws://127.0.0.1:PORT` moves the engine's WebSocket."
            )
    return None


@dataclass(frozen=True)
class Progress:
    """The last progress bar the engine printed (tqdm style), as a fraction."""

    label: str
    fraction: float


def parse_progress(line: str) -> Progress | None:
    m = _PROGRESS.search(line.strip())
    if m is None:
        return None
    return Progress(m.group("label").strip() or "loading", min(int(m.group("pct")), 100) / 100)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the app is killed, the engine goes too.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineProcess:
    """One engine subprocess; `state` is "starting", "ready" or "exited"."""

    def __init__(self, argv: list[str], cwd: Path = PROJECT_ROOT, keep_lines: int = 300) -> None:
        self.argv = argv
        self.cwd = cwd
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self.progress: Progress | None = None
        self.returncode: int | None = None
        self.ready_url: str | None = None
        self.started_at = time.monotonic()
        self._proc: subprocess.Popen[str] | None = None
        self._spawned = threading.Event()
        self._lock = threading.Lock()
        # The thread that spawns the child also waits for it: PR_SET_PDEATHSIG fires when the
        # spawning *thread* exits, so it must outlive the child.
        self._thread = threading.Thread(target=self._run, name="stepscope-engine", daemon=True)

    @property
    def state(self) -> str:
        if self.returncode is not None:
            return "exited"
        return "ready" if self.ready_url else "starting"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> EngineProcess:
        self._thread.start()
        self._spawned.wait(10)
        atexit.register(self.stop)
        return self

    def _run(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        try:
            proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,  # universal newlines: a progress bar's "\r" updates become lines
                bufsize=1,
                preexec_fn=preexec,
            )
        except OSError as exc:
            self.lines.append(f"cannot start {self.argv[0]}: {exc}")
            self.returncode = -1
            self._spawned.set()
            return
        self._proc = proc
        self._spawned.set()
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            if not line:
                continue
            with self._lock:
                self.lines.append(line)
                progress = parse_progress(line)
                if progress is not None:
                    self.progress = progress
                if self.ready_url is None and "ws://" in line and "ready" in line:
                    self.ready_url = line[line.index("ws://") :].split()[0]
        self.returncode = proc.wait()

    def tail(self, n: int = 12) -> list[str]:
        with self._lock:
            return list(self.lines)[-n:]

    def stop(self, timeout: float = 10.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        self._thread.join(timeout)


class Launcher:
    """The app's engine subprocess, if it started one: at most one at a time per app process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.process: EngineProcess | None = None

    def start(self, argv: list[str]) -> EngineProcess:
        """Start an engine unless one this launcher started is still starting or running."""
        with self._lock:
            if self.process is not None and self.process.state != "exited":
                return self.process
            self.process = EngineProcess(argv).start()
            return self.process

    def restart(self, argv: list[str]) -> EngineProcess:
        with self._lock:
            if self.process is not None:
                self.process.stop()
            self.process = EngineProcess(argv).start()
            return self.process

    def stop(self) -> None:
        with self._lock:
            if self.process is not None:
                self.process.stop()


def should_autostart(
    url: str, connected_before: bool, failed_attempts: int, enabled: bool, started: bool
) -> bool:
    """Start an engine only when a local URL has never answered and none was started yet.

    An engine that answered once and then died is not restarted behind the user's back: the
    page says so and offers a restart button instead.
    """
    return (
        enabled
        and not started
        and not connected_before
        and failed_attempts >= 1
        and local_port(url) is not None
    )
