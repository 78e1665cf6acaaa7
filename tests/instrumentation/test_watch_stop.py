"""Traces that keep everything served: each line is flushed as it is written, and a
watch stopped by SIGTERM (a service manager) or SIGINT (Ctrl-C) exits cleanly with every message
it served in its trace: the log watch and the KV-events watch alike."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from websockets.sync.client import connect

from instrumentation.trace import TraceWriter, read_jsonl
from tests.server.test_server_support import child_env

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "watch"
CAPTURE = FIXTURES / "vllm_0.32_cpu_capture"


def test_each_trace_line_reaches_the_file_as_it_is_written(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "t.jsonl")
    for i in range(3):
        writer({"type": "step", "step": i}, json.dumps({"type": "step", "step": i}))
        # read by another handle while the writer is still open: nothing waits in a buffer
        assert [m["step"] for m in read_jsonl(tmp_path / "t.jsonl")] == list(range(i + 1))
    writer.close()
    writer.write("{}")  # after close (shutting down): dropped, not a crash
    assert writer.lines == 3


def served_then_stopped(args: list[str], trace: Path, sig: int, until: str, count: int) -> list:
    """Run the watch, take `count` messages of type `until` over WebSocket, send `sig`; returns
    what the client received."""
    argv = [sys.executable, "-m", "instrumentation.watch", *args, "--port", "0"]
    argv += ["--trace", str(trace)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=child_env(PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        url = next(ln[ln.index("ws://") :].strip() for ln in proc.stderr if "ws://" in ln)
        err: list[str] = []
        threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True).start()
        received: list[dict] = []
        with connect(url, open_timeout=20) as ws:
            hello = json.loads(ws.recv(timeout=20))
            received += hello["history"]["steps"] + hello["history"]["kv_events"]
            while sum(m["type"] == until for m in received) < count:
                received.append(json.loads(ws.recv(timeout=20)))
        proc.send_signal(sig)
        assert proc.wait(20) == 0
        proc.stderr.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return received


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_log_watch_keeps_every_message_it_served(tmp_path: Path, sig: int) -> None:
    log = tmp_path / "server.log"
    log.write_text((FIXTURES / "sglang_2024-11_chunked_2048.log").read_text())
    trace = tmp_path / "watch.jsonl"
    received = served_then_stopped(
        ["sglang-log", str(log), "--follow"], trace, sig, until="step", count=7
    )
    written = list(read_jsonl(trace))
    assert written[0]["type"] == "hello"
    assert [m for m in written[1:] if m["type"] == "step"] == received
    assert len(received) == 7


def test_a_stopped_kv_events_watch_keeps_every_batch(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    trace = tmp_path / "kv.jsonl"
    frames = str(CAPTURE / "kv_events.frames")
    received = served_then_stopped(
        ["vllm-kv-events", frames], trace, signal.SIGTERM, until="kv_events", count=4
    )
    written = [m for m in read_jsonl(trace) if m["type"] == "kv_events"]
    assert written == received and len(written) == 4
