"""Starting and stopping the server: safe defaults, clean shutdown, and the trace it leaves."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from instrumentation.steps import stalls
from tests.server.test_server_support import ROOT, ServerProcess, child_env


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
        text=True, timeout=60, env=child_env(),
    )  # fmt: skip
    assert out.returncode == 2 and message in out.stderr and "loading" not in out.stderr


def serve_in_process(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`python -m engine.server ARGS` run to its exit status in this process, which has torch
    imported already: a refusal that comes after the engine's imports is seen without a fresh
    process importing torch again (seconds of CPU). Returns the status and what it wrote to
    stderr (the API process it spawned included); an exception escaping it fails the test, as
    its traceback would."""
    from engine.server.core import main

    capfd.readouterr()
    code = main(list(args))
    return code, capfd.readouterr().err


def test_a_missing_model_is_a_clear_error(capfd: pytest.CaptureFixture[str]) -> None:
    code, err = serve_in_process(
        capfd, "--model", "/nonexistent/model", "--port", "0", "--http-port", "0"
    )
    assert code == 2 and "cannot start the engine" in err
    assert "Traceback" not in err


def test_batch_invariant_without_cuda_is_a_clear_error(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    # as CI: no GPU, so the Triton kernels cannot run (nor under Triton's interpreter)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = serve_in_process(capfd, "--batch-invariant", "--port", "0", "--http-port", "0")
    assert code == 2 and "cannot start the engine: batch_invariant" in err
    assert "Traceback" not in err


def test_a_busy_port_is_reported_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "engine.server", "--model", "/nonexistent", "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, env=child_env(),
        )  # fmt: skip
    assert out.returncode == 2 and "cannot listen" in out.stderr and "loading" not in out.stderr


def test_trace_and_clean_shutdown(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A whole run, stopped by Ctrl-C's signal; `--http-port none` turns the HTTP API off (its
    ready line is never printed) and leaves the WebSocket serving. A SIGTERM stop with the HTTP
    API on, its freed port and its whole trace are checked on test_one_truth's recorded run,
    which starts a server anyway."""
    trace = tmp_path / "run.jsonl"
    server = ServerProcess(
        tiny_llama_dir, "--max-extend-tokens", "8", "--http-port", "none", trace=trace
    )
    c = server.client()
    rng = random.Random(int(signal.SIGINT))
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (20, 5)]
    uids = []
    for k, prompt in enumerate(prompts):
        reply = c.reply({"type": "submit", "id": f"t{k}", "input_ids": prompt, "max_tokens": 3})
        uids.append(reply["uid"])
    for uid in uids:
        c.until(lambda m, u=uid: m.get("event") == "finished" and m["uid"] == u)
    code, err = server.stop(signal.SIGINT)
    assert code == 0 and "Traceback" not in err and "did not stop" not in err, err
    assert port_is_free(server.port)
    http_lines = [line for line in server.stdout_after_ready if "HTTP API" in line]
    assert not http_lines, server.stdout_after_ready

    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["type"] == "hello" and lines[0]["engine"]["vocab_size"] == 49152
    assert {m["type"] for m in lines[1:]} == {"step", "token", "request"}
    assert lines[1:] == [m for m in c.seen if m["type"] in ("step", "token", "request")]

    out_json = tmp_path / "run.json"
    cli = subprocess.run(
        [sys.executable, "-m", "instrumentation.trace", str(trace), str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=child_env(),
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
