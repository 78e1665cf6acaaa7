"""Trace export: JSON lines in, a Chrome trace (Perfetto) out, without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from instrumentation import messages
from instrumentation.records import (
    KVStats,
    QueueStats,
    RequestEvent,
    StepItem,
    StepRecord,
    TokenEvent,
)
from instrumentation.trace import TraceWriter, read_jsonl, to_chrome_trace
from tests.server.test_server_support import child_env

ROOT = Path(__file__).resolve().parents[2]


def session() -> list[dict[str, Any]]:
    """Request 0 is chunked over two steps then decodes; request 1 waits and is aborted."""
    kv = KVStats(total=64, used=10, cached=0, free=54, reserved=4)
    q = QueueStats(waiting=1, running=1)

    def step(n: int, t0: float, phase: str, *items: StepItem) -> dict[str, Any]:
        return StepRecord(n, t0, t0 + 0.1, phase, 4, "prefill_first", items, kv, q).to_dict()  # type: ignore[arg-type]

    empty = {"steps": [], "requests": []}
    done = {"output_len": 2, "finish_reason": "length", "text": "Hi!"}
    return [
        messages.hello(0.0, {"model": "tiny"}, {"max_extend_tokens": 4}, empty),
        RequestEvent(0, "queued", 0.0, {"prompt_len": 6, "max_tokens": 2}).to_dict(),
        RequestEvent(1, "queued", 0.05, {"prompt_len": 3, "max_tokens": 2}).to_dict(),
        step(0, 0.1, "prefill", StepItem(0, "chunk", 0, 4)),
        RequestEvent(0, "admitted", 0.1, {"cached_len": 0}).to_dict(),
        step(1, 0.2, "prefill", StepItem(0, "prefill", 4, 6)),
        TokenEvent(0, 0.3, 5, "Hi").to_dict(),
        RequestEvent(0, "first_token", 0.3).to_dict(),
        messages.config("c1", 0.32, {"max_extend_tokens": 8, "policy": "mixed"}),
        step(2, 0.4, "decode", StepItem(0, "decode", 6, 7)),
        TokenEvent(0, 0.5, 6, "!").to_dict(),
        RequestEvent(0, "finished", 0.5, done).to_dict(),
        RequestEvent(1, "aborted", 0.6).to_dict(),
    ]  # fmt: skip


def write_session(path: Path) -> None:
    writer = TraceWriter(path)
    for msg in session():
        writer(msg, json.dumps(msg))
    writer.close()
    assert writer.lines == len(session())


def test_chrome_trace_has_a_step_track_and_one_track_per_request(tmp_path: Path) -> None:
    write_session(tmp_path / "run.jsonl")
    trace = to_chrome_trace(read_jsonl(tmp_path / "run.jsonl"))
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {(1, 1): "engine steps", (2, 0): "request 0", (2, 1): "request 1"}

    def slices(pid: int, tid: int) -> list[tuple[str, float, float]]:
        got = [e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == (pid, tid)]
        return [(e["name"], round(e["ts"]), round(e["dur"])) for e in got]

    assert slices(1, 1) == [
        ("prefill #0", 100_000, 100_000),
        ("prefill #1", 200_000, 100_000),
        ("decode #2", 400_000, 100_000),
    ]
    assert slices(2, 0) == [
        ("waiting", 0, 100_000),
        ("chunk [0:4)", 100_000, 100_000),
        ("prefill [4:6)", 200_000, 100_000),
        ("decode", 400_000, 100_000),
    ]
    assert slices(2, 1) == [("waiting", 50_000, 550_000)]
    instants = {(e["tid"], e["name"]) for e in events if e["ph"] == "i"}
    assert {(0, "first_token"), (0, "finished"), (1, "aborted"), (1, "set_config")} <= instants
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"kv pages", "queue", "tokens"} <= counters
    process = [e for e in events if e["name"] == "process_name" and e["pid"] == 1]
    assert process[0]["args"]["name"] == "engine: tiny"


def test_cli_writes_valid_json_without_importing_torch(tmp_path: Path) -> None:
    src, dst = tmp_path / "run.jsonl", tmp_path / "run.json"
    write_session(src)
    with src.open("a") as f:
        f.write('{"type": "step", "truncat')  # a writer killed mid-line
    code = (
        "import sys; from instrumentation.trace import main; "
        f"rc = main([{str(src)!r}, {str(dst)!r}]); "
        "assert 'torch' not in sys.modules, 'trace export imported torch'; sys.exit(rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=child_env()
    )
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout
    trace = json.loads(dst.read_text())
    assert trace["displayTimeUnit"] == "ms"
    assert all({"ph", "pid", "tid", "name"} <= e.keys() for e in trace["traceEvents"])
    cli = subprocess.run(
        [sys.executable, "-m", "instrumentation.trace", str(src), str(tmp_path / "b.json")],
        cwd=ROOT, capture_output=True, text=True, env=child_env(),
    )  # fmt: skip
    assert cli.returncode == 0 and json.loads((tmp_path / "b.json").read_text()) == trace


def test_cli_reports_a_missing_file(tmp_path: Path) -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "instrumentation.trace", str(tmp_path / "no.jsonl"), "x.json"],
        cwd=ROOT, capture_output=True, text=True, env=child_env(),
    )  # fmt: skip
    assert cli.returncode == 1 and "error" in cli.stderr and "Traceback" not in cli.stderr


def test_hello_history_steps_are_included() -> None:
    step = session()[3]
    hello = messages.hello(1.0, {"model": "m"}, {}, {"steps": [step], "requests": []})
    trace = to_chrome_trace([hello])
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == [
        "prefill #0",
        "chunk [0:4)",
    ]


def test_stalls_wasted_work_and_metrics_come_from_the_shared_fold() -> None:
    """A request skipped by two steps gets one stall slice spanning them; an item marked wasted
    is drawn as wasted; the finished instant carries the fold's metrics."""

    def step(n: int, items: list[dict]) -> dict:
        return {"type": "step", "step": n, "t0": n * 1.0, "t1": n * 1.0 + 0.5, "phase": "mixed",
                "items": items}  # fmt: skip

    dec = {"uid": 0, "kind": "decode", "start": 5, "end": 6}
    msgs = [
        {"type": "request", "uid": 0, "event": "queued", "t": 0.0, "prompt_len": 5},
        {"type": "request", "uid": 1, "event": "queued", "t": 0.0, "prompt_len": 9},
        step(0, [{"uid": 0, "kind": "prefill", "start": 0, "end": 5}]),
        {"type": "token", "uid": 0, "t": 0.5, "token_id": 1, "text": "a"},
        step(1, [{"uid": 1, "kind": "chunk", "start": 0, "end": 4}]),
        step(2, [{"uid": 1, "kind": "chunk", "start": 4, "end": 8}]),
        step(3, [dec, {"uid": 1, "kind": "prefill", "start": 8, "end": 9, "wasted": True}]),
        {"type": "token", "uid": 0, "t": 3.5, "token_id": 2, "text": "b"},
        {"type": "request", "uid": 0, "event": "finished", "t": 3.5, "output_len": 2},
    ]
    events = to_chrome_trace(msgs)["traceEvents"]
    (stall,) = [e for e in events if e.get("cat") == "stall"]
    assert stall["tid"] == 0 and stall["args"]["steps"] == [1, 2]
    assert stall["args"]["seconds"] == pytest.approx(3.0)
    (wasted,) = [e for e in events if e.get("cat") == "wasted"]
    assert wasted["tid"] == 1 and wasted["args"]["wasted"] is True
    (done,) = [e for e in events if e.get("name") == "finished"]
    assert done["args"]["max_stall_seconds"] == pytest.approx(3.0)
    assert done["args"]["time_to_first_token_seconds"] == pytest.approx(0.5)
