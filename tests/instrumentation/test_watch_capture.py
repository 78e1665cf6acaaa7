"""A recorded vLLM 0.32 CPU run replays to the same steps and KV picture.

tests/fixtures/watch/vllm_0.32_cpu_capture holds what a real vLLM printed and published while
serving the bundled SmolLM2 (CAPTURE.md: the version and the command): its log, its KV-event
frames as the raw multipart bytes the watch received, and its own /metrics counters before and
after the load. The watch converts the log with the frames beside it, as a user would, and the
result is checked against the capture itself, read independently here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from instrumentation.trace import read_jsonl
from instrumentation.watch.__main__ import main
from instrumentation.watch.kv_events import hit_rate

msgpack = pytest.importorskip("msgpack")

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "watch" / "vllm_0.32_cpu_capture"
LOG, FRAMES = CAPTURE / "vllm.log", CAPTURE / "kv_events.frames"
ITERATION = re.compile(
    r"Engine (\d+): Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, "
    r"(\d+) generation requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms, "
    r"(\w+) KV cache usage: ([\d.]+)%$"
)


def replay(tmp_path: Path, name: str = "replay.jsonl") -> list[dict]:
    out = tmp_path / name
    argv = ["vllm-log", str(LOG), "--kv-events", str(FRAMES), "--log-timezone", "UTC"]
    assert main([*argv, "--trace", str(out)]) == 0
    return list(read_jsonl(out))


def capture_frames() -> list[tuple[int, list]]:
    from instrumentation.watch.frames import read_frames

    out = []
    for _, frames in read_frames(FRAMES):
        ts, events, _rank = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
        out.append((int.from_bytes(frames[1], "big"), events))
    return out


def test_the_capture_says_what_made_it() -> None:
    text = (CAPTURE / "CAPTURE.md").read_text()
    assert "vLLM 0.32.0" in text and "--enable-logging-iteration-details" in text
    assert "--kv-events-config" in text and '"endpoint": "tcp://*:' in text
    assert "version 0.32.0" in LOG.read_text()  # vLLM's own banner in the log


def test_the_capture_replays_to_one_step_per_iteration_line(tmp_path: Path) -> None:
    messages = replay(tmp_path)
    hello, steps = messages[0], [m for m in messages if m["type"] == "step"]
    lines = [m for m in map(ITERATION.search, LOG.read_text().splitlines()) if m]
    assert len(steps) == len(lines) > 10
    assert hello["engine"]["vllm_version"] == "0.32.0"
    assert hello["engine"]["model"] == "SmolLM2-135M-Instruct"
    for step, m in zip(steps, lines, strict=True):
        assert (step["dp_rank"], step["iteration"]) == (int(m.group(1)), int(m.group(2)))
        assert step["prefill_requests"] == int(m.group(3))
        assert step["prompt_tokens"] == int(m.group(4))
        assert step["decode_requests"] == int(m.group(5))
        assert step["decode_tokens"] == int(m.group(6))
        assert step["t1"] - step["t0"] == pytest.approx(float(m.group(7)) / 1000, abs=1e-6) or (
            step["t0"] == steps[steps.index(step) - 1]["t1"]  # clipped: never overlaps
        )
        assert step["kv"] == {"unit": "block", "device": "CPU", "usage": float(m.group(9)) / 100}
        assert step["t_source"] == "estimated"
    ends = [s["t1"] for s in steps]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)  # never stacked
    # The prompt tokens computed equal vLLM's own counters for the run.
    delta = json.loads((CAPTURE / "metrics_delta.json").read_text())
    computed = delta["vllm:prompt_tokens_by_source_total[local_compute]"]
    assert sum(s["prompt_tokens"] for s in steps) == computed
    assert computed == delta["vllm:prompt_tokens_total"] - delta["vllm:prompt_tokens_cached_total"]


def test_the_capture_replays_to_the_same_kv_picture(tmp_path: Path) -> None:
    messages = replay(tmp_path)
    steps = [m for m in messages if m["type"] == "step"]
    kv = [m for m in messages if m["type"] == "kv_events"]
    published = capture_frames()
    assert [m["batch_seq"] for m in kv] == [seq for seq, _ in published]
    # The test's own reading of the frames: blocks first stored, and stored again (reuse).
    held: set = set()
    stored = reused = 0
    for _, events in published:
        for event in events:
            if event["type"] == "BlockStored":
                for h in event["block_hashes"]:
                    key = tuple(h) if isinstance(h, list) else h
                    reused += key in held
                    stored += key not in held
                    held.add(key)
    assert sum(m["stored_blocks"] for m in kv) == stored > 0
    assert sum(m["reused_blocks"] for m in kv) == reused > 0  # the long prompt's second run
    assert kv[-1]["blocks"] == len(held) and kv[-1]["block_size"] == 128
    assert hit_rate(kv) == pytest.approx(reused / (reused + stored))
    # Each batch is placed on the log's clock by its engine time, inside the run's steps, and
    # after a step that computed prompt tokens (vLLM stores blocks as prefill fills them).
    assert {m["t_source"] for m in kv} == {"engine"}
    for m in kv:
        before = [s for s in steps if s["t1"] <= m["t"] + 1.0]
        assert before and any(s["prompt_tokens"] for s in before[-3:])


def test_a_replay_is_deterministic(tmp_path: Path) -> None:
    def comparable(messages: list[dict]) -> list[dict]:
        return [m for m in messages if m["type"] != "hello"]

    assert comparable(replay(tmp_path, "a.jsonl")) == comparable(replay(tmp_path, "b.jsonl"))
