"""The page's parts for a watched engine, without a browser: one lane per
data-parallel rank and the rank filter on steps the watch made of a real log fixture, the notes
on estimated times and lost KV events, and the prefix-cache hit rate from KV events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app import external

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "watch"
Message = dict[str, Any]


def converted(tmp_path: Path, source: str, fixture: str) -> tuple[Message, list[Message]]:
    """The watch's own conversion of a fixture log: its hello and its steps."""
    out = tmp_path / "out.jsonl"
    subprocess.run(
        [sys.executable, "-m", "instrumentation.watch", source, str(FIXTURES / fixture),
         "--trace", str(out)],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    messages = [json.loads(line) for line in out.read_text().splitlines()]
    return messages[0], [m for m in messages if m["type"] == "step"]


def test_each_data_parallel_rank_gets_its_own_lane_and_a_filter(tmp_path: Path) -> None:
    _, steps = converted(tmp_path, "sglang-log", "sglang_2025-05_dp_attention.log")
    assert external.dp_ranks(steps) == [0, 2, 5, 6, 7]
    fig = external.rank_lanes_figure(steps, "time")
    lanes = {y for trace in fig.data for y in trace.y}
    assert lanes == {"DP rank 0", "DP rank 2", "DP rank 5", "DP rank 6", "DP rank 7"}
    assert sum(len(trace.x) for trace in fig.data) == len(steps)  # one bar per step
    only = external.of_rank(steps, 6)
    assert [s["dp_rank"] for s in only] == [6] and external.of_rank(steps, None) == steps
    assert external.time_note(steps) == external.ESTIMATED_NOTE  # stamps to the second


def test_the_page_says_what_kv_events_could_not_tell() -> None:
    kv = [
        {"type": "kv_events", "t": 1.0, "stored_blocks": 4, "reused_blocks": 0, "blocks": 4},
        {"type": "kv_events", "t": 2.0, "stored_blocks": 1, "reused_blocks": 3, "blocks": 5,
         "gap": {"lost": 2, "recovered": 1}},
    ]  # fmt: skip
    note = external.kv_gap_note(kv)
    assert note is not None and note.startswith("2 KV-event batches were missed")
    assert external.kv_gap_note(kv[:1]) is None
    fig = external.kv_hit_rate_figure(kv)
    assert fig is not None and list(fig.data[0].y) == [None, pytest.approx(100 * 3 / 8)]
    assert external.kv_hit_rate_figure(kv[:1]) is None  # no reuse reported: no hit rate drawn
