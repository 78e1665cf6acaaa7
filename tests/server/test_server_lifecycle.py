"""Starting and stopping the server: safe defaults, clean shutdown, and the trace it leaves."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from instrumentation.steps import stalls
from tests.server.test_server_support import ROOT, ServerProcess


def port_is_free(port: int) -> bool:
    """Whether a new server could listen there (with SO_REUSEADDR, as asyncio's servers do)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host", "0.0.0.0"], "--token"),
        (["--port", "70000"], "--port"),
        (["--max-extend-tokens", "0"], "--max-extend-tokens"),
        (["--policy", "fastest"], "--policy"),
    ],
)
def test_unsafe_or_bad_arguments_are_refused_before_loading(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine.server", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and message in out.stderr and "loading" not in out.stderr


def test_a_missing_model_is_a_clear_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine.server", "--model", "/nonexistent/model", "--port", "0",
         "--http-port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "cannot start the engine" in out.stderr
    assert "Traceback" not in out.stderr


def test_batch_invariant_without_cuda_is_a_clear_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as CI: no GPU, so the Triton kernels cannot run
    out = subprocess.run(
        [sys.executable, "-m", "engine.server", "--batch-invariant", "--port", "0",
         "--http-port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 2 and "cannot start the engine: batch_invariant" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_busy_port_is_reported_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "engine.server", "--model", "/nonexistent", "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2 and "cannot listen" in out.stderr and "loading" not in out.stderr


@pytest.mark.parametrize(
    ("sig", "http_port"), [(signal.SIGTERM, "0"), (signal.SIGINT, "none")],
    ids=["SIGTERM", "SIGINT-http-port-none"],
)  # fmt: skip
def test_trace_and_clean_shutdown(
    tiny_llama_dir: Path, tmp_path: Path, sig: int, http_port: str
) -> None:
    """A whole run, stopped by either signal; `--http-port none` turns the HTTP API off (its
    ready line is never printed) and leaves the WebSocket serving."""
    trace = tmp_path / "run.jsonl"
    server = ServerProcess(
        tiny_llama_dir, "--max-extend-tokens", "8", "--http-port", http_port, trace=trace
    )
    c = server.client()
    rng = random.Random(int(sig))
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (20, 5)]
    uids = []
    for k, prompt in enumerate(prompts):
        reply = c.reply({"type": "submit", "id": f"t{k}", "input_ids": prompt, "max_tokens": 3})
        uids.append(reply["uid"])
    for uid in uids:
        c.until(lambda m, u=uid: m.get("event") == "finished" and m["uid"] == u)
    code, err = server.stop(sig)
    assert code == 0 and "Traceback" not in err and "did not stop" not in err, err
    assert port_is_free(server.port)
    http_lines = [line for line in server.stdout_after_ready if "HTTP API" in line]
    assert len(http_lines) == (0 if http_port == "none" else 1), server.stdout_after_ready

    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["type"] == "hello" and lines[0]["engine"]["vocab_size"] == 49152
    assert {m["type"] for m in lines[1:]} == {"step", "token", "request"}
    assert lines[1:] == [m for m in c.seen if m["type"] in ("step", "token", "request")]

    out_json = tmp_path / "run.json"
    cli = subprocess.run(
        [sys.executable, "-m", "instrumentation.trace", str(trace), str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    events = json.loads(out_json.read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {(1, 1): "engine steps", **{(2, u): f"request {u}" for u in uids}}
    long_uid = uids[0]
    kinds = [e["cat"] for e in events if e["ph"] == "X" and e["pid"] == 2 and e["tid"] == long_uid]
    assert [k for k in kinds if k != "stall"] == ["waiting", "chunk", "chunk", "prefill",
                                                  "decode", "decode"]  # fmt: skip
    # The Chrome trace's stalls are exactly the protocol's, computed from the recorded steps.
    # Prefill-first: a step with prompt work holds no decode, so if the short prompt's work began
    # before the long one ended (the two submits race the engine), the long one stalls.
    steps = [m for m in lines[1:] if m["type"] == "step"]
    want = [x for x in stalls(steps) if x.uid == long_uid]
    assert kinds.count("stall") == len(want)

    def ran(uid: int) -> list[int]:
        return [k for k, st in enumerate(steps) if any(i["uid"] == uid for i in st["items"])]

    if ran(uids[1])[0] < ran(long_uid)[-1]:
        assert want
    assert len(steps) == sum(1 for e in events if e["ph"] == "X" and e["pid"] == 1)
