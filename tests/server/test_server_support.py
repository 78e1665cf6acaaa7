"""Helpers for the server and publisher tests: a server subprocess, protocol clients, a stuck peer.

Imported by tests/test_server*.py and tests/instrumentation/test_instrumentation_publisher.py; holds no tests.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parents[2]
Msg = dict[str, Any]


def stuck_client(port: int, path: str = "/") -> socket.socket:
    """A WebSocket peer that completes the handshake and then never reads (nor answers pings)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up soon
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        .encode()
    )  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)  # byte by byte: read nothing past the handshake
        assert chunk, "server closed during the handshake"
        head += chunk
    assert head.split(b"\r\n", 1)[0].split()[1] == b"101", head
    return sock


def is_reset(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed `sock`, draining what it had sent until EOF or a reset."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 20):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


class ProtoClient:
    """A blocking protocol client that keeps every message it has received."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        # max_queue=None: the connection's thread reads every frame as it arrives, so a client
        # a test has stopped using never stalls the server's sends nor its close (a full queue
        # of 16 frames would make every server stop wait out its 2 s close timeout)
        self.ws: ClientConnection = connect(
            url, max_size=None, compression=None, legacy=True, max_queue=None, **kwargs
        )
        self.seen: list[Msg] = []
        self._unclaimed: list[Msg] = []  # received while waiting for something else
        self.hello = self.recv()
        assert self.hello["type"] == "hello"

    def send(self, obj: Msg | str | bytes) -> None:
        self.ws.send(obj if isinstance(obj, str | bytes) else json.dumps(obj))

    def recv(self, timeout: float = 60.0) -> Msg:
        msg = json.loads(self.ws.recv(timeout=timeout))
        self.seen.append(msg)
        return msg

    def until(self, pred: Callable[[Msg], bool], timeout: float = 120.0) -> Msg:
        """The first message not yet returned that satisfies `pred`: one that arrived while an
        earlier call waited for something else (a fast engine can finish a request before the
        reply to the next submit), or the next to arrive. Generous timeout: never a speed
        assertion."""
        for i, msg in enumerate(self._unclaimed):
            if pred(msg):
                del self._unclaimed[i]
                return msg
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(timeout=max(0.1, deadline - time.monotonic()))
            if pred(msg):
                return msg
            self._unclaimed.append(msg)

    def reply(self, command: Msg) -> Msg:
        """Send a command with an id and return the reply that echoes it."""
        self.send(command)
        return self.until(lambda m: m.get("id") == command["id"] and m["type"] != "request")

    def stats(self, tag: str = "s") -> Msg:
        return self.reply({"type": "stats", "id": f"stats-{tag}-{len(self.seen)}"})

    def close(self) -> None:
        self.ws.close()


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a Python process a test starts, plus `extra` (with the suite's
    bytecode cache: tests/__init__.py)."""
    return {**os.environ, **extra}


class ServerProcess:
    """`python -m engine.server` on a free loopback port (`--port 0`), stopped with SIGTERM."""

    def __init__(self, model: str | Path, *extra: str, trace: Path | None = None) -> None:
        # --http-port 0: the OpenAI API's default port 8000 would collide between servers
        args = [sys.executable, "-m", "engine.server", "--model", str(model), "--port", "0",
                "--http-port", "0", *extra]  # fmt: skip
        if trace is not None:
            args += ["--trace", str(trace)]
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # One torch thread: on a shared 2-core machine, OpenMP workers that spin-wait for a
            # descheduled peer turn 4 ms steps into 200 ms ones, drowning what tests compare.
            env=child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
        )  # fmt: skip
        # drain stderr from the start and stdout once ready: a server blocked writing to a
        # full pipe would look exactly like a hung engine
        self._err: list[str] = []
        self._err_reader = self._drain(self.proc.stderr, self._err)
        self.url = self._wait_ready()
        self.port = int(self.url.rsplit(":", 1)[1])
        self.stdout_after_ready: list[str] = []  # whole once `stop()` returned
        self._out_reader = self._drain(self.proc.stdout, self.stdout_after_ready)

    @staticmethod
    def _drain(stream: Any, sink: list[str]) -> threading.Thread:
        t = threading.Thread(target=lambda: sink.extend(stream), daemon=True)
        t.start()
        return t

    def _wait_ready(self, timeout: float = 300.0) -> str:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = self.proc.stdout.readline()
                if line.startswith("stepscope engine ready at "):
                    return line.split(" at ", 1)[1].strip()
                if not line and self.proc.poll() is not None:
                    break
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"server did not start: {''.join(self._err)[-3000:]}")

    def client(self, **kwargs: Any) -> ProtoClient:
        return ProtoClient(self.url, **kwargs)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Signal the server; return its exit status and stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for reader in (self._err_reader, self._out_reader):
            reader.join(timeout=10)  # what the process wrote last, up to EOF
        return self.proc.returncode, "".join(self._err)


@contextmanager
def running_server(
    model: str | Path, *extra: str, trace: Path | None = None
) -> Iterator[ServerProcess]:
    server = ServerProcess(model, *extra, trace=trace)
    try:
        yield server
    finally:
        code, err = server.stop()
        assert "Traceback" not in err, err
        assert "did not stop" not in err, err  # the API process ends after the engine's END
        assert code == 0, err


class ApiServer(ServerProcess):
    """The server subprocess, also reading the HTTP API's ready line (printed right after the
    WebSocket's)."""

    http_url: str

    def _wait_ready(self, timeout: float = 300.0) -> str:
        url = super()._wait_ready(timeout)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("stepscope HTTP API at "), line
        self.http_url = line.split(" at ", 1)[1].strip()
        return url


def stop(server: ServerProcess) -> None:
    """SIGTERM, and the clean exit it must give."""
    code, err = server.stop()
    assert "Traceback" not in err, err
    assert "did not stop" not in err, err  # the API process ends after the engine's END
    assert code == 0, err


# The limits of the server that test_openai_api and test_server's synchronous-engine runs share
# (tests/server/conftest.py): sixteen concurrent streams fit, and filling it is still quick.
MAX_RUNNING = 8
MAX_WAITING = 32
SHARED_FLAGS = ("--max-running-req", str(MAX_RUNNING), "--max-waiting", str(MAX_WAITING),
                "--metrics-compat", "vllm")  # fmt: skip


def test_the_api_process_collects_garbage_only_while_the_engine_is_quiet() -> None:
    """Automatic collection is off while serving (a full one stalled every stream at once);
    a collection runs once events pause, and at the latest after MAX_EVERY_S of load."""
    import gc
    import time

    from engine.server.frontend import IdleCollector

    last = [time.monotonic()]
    collector = IdleCollector(lambda: last[0])
    try:
        assert not gc.isenabled()
        collector.IDLE_EVERY_S = 0.0
        collector.tick()  # events still flowing: no collection
        assert collector.collections == 0
        last[0] -= 10 * collector.QUIET_S  # the engine went quiet
        collector.tick()
        assert collector.collections == 1
        last[0] = time.monotonic() + 3600  # events flowing again
        collector.MAX_EVERY_S = 0.0  # ... for longer than the longest wait
        collector.tick()
        assert collector.collections == 2
    finally:
        collector.close()
    assert gc.isenabled()
