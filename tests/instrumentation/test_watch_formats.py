"""Every SGLang and vLLM fixture reads with zero misread fields.

Each fixture (tests/fixtures/watch, verbatim from public threads; SOURCES.md) is read by the
watch, and each batch line is read again here, independently: cut into `name: value` segments,
each segment's value is looked up in the step under the name docs/watch.md gives it. A segment
the watch did not read must be in the step's `unread` list, and the count of those is asserted
per file: a new upstream field shows up as a failing count, never as a silently wrong figure.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from instrumentation.watch.sglang_log import SglangLogReader
from instrumentation.watch.vllm_log import VllmLogReader

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "watch"

# fixture -> (steps, unread fields, lines repeated by other TP/PP/CP ranks)
EXPECTED: dict[str, tuple[int, int, int]] = {
    "sglang_2024-04_fill_batch.log": (6, 0, 0),
    "sglang_2024-08_decode_time_only.log": (10, 0, 0),
    "sglang_2024-10_tqdm_interleaved.log": (7, 0, 0),
    "sglang_2024-11_chunked_2048.log": (7, 0, 0),
    "sglang_2025-01_decode_retract.log": (5, 0, 0),
    "sglang_2025-05_dp_attention.log": (5, 0, 0),
    "sglang_2025-06_pd_decode_dp32.log": (7, 0, 0),
    "sglang_2025-07_pd_decode_retracted.log": (3, 0, 0),
    "sglang_2025-09_musa_indented.log": (6, 0, 0),
    "sglang_2025-10_pd_prefill_unbootstrapped.log": (5, 0, 0),
    "sglang_2025-11_decode_trailing_comma.log": (8, 0, 0),
    "sglang_2025-11_prefill_trailing_comma.log": (9, 0, 0),
    "sglang_2026-01_musa_dp2.log": (4, 0, 0),
    "sglang_2026-03_ray_actor_prefix.log": (7, 0, 0),
    "sglang_2026-04_hisparse_decode.log": (6, 0, 0),
    "sglang_2026-04_http_interleaved.log": (4, 0, 0),
    # the paste itself is garbled: overlapping terminal columns (`#cached-tounning-req: 45`)
    "sglang_2026-05_garbled_terminal_copy.log": (6, 12, 0),
    "sglang_2026-06_pd_prefill_npu_pp_cp.log": (1, 0, 7),
    "sglang_2026-07_mamba_pending.log": (5, 0, 0),
    "sglang_2026-08_swa_chunk_end_spec_decode.log": (4, 0, 0),
    "sglang_2026-08_swa_chunked_long_prompt.log": (4, 0, 0),
    "vllm_2025-12_iteration_details.log": (3, 0, 0),
    "vllm_2025-12_stat_logger_lines.log": (0, 0, 0),
    "vllm_0.32_cpu_capture/vllm.log": (-1, 0, 0),  # -1: as many as its iteration lines
}

# The test's own table: upstream segment name -> where docs/watch.md says the value goes.
SGLANG_NAMES: dict[str, tuple[str, ...]] = {
    "#new-seq": ("prefill_requests",), "#seq": ("prefill_requests",),
    "#new-token": ("prompt_tokens",), "#new_token": ("prompt_tokens",),
    "#cached-token": ("cached_tokens",), "#cached_token": ("cached_tokens",),
    "cache hit rate": ("lifetime_cache_hit_rate",),
    "tree_cache_hit_rate": ("lifetime_cache_hit_rate",),
    "token usage": ("kv", "usage"), "full token usage": ("kv", "usage"),
    "gpu token usage": ("kv", "usage"),
    "#token": ("kv", "used"), "#full token": ("kv", "used"),
    "#gpu-token": ("kv", "used"), "#gpu token": ("kv", "used"),
    "swa token usage": ("kv", "pools", "swa", "usage"), "#swa token": ("kv", "pools", "swa", "used"),
    "mamba usage": ("kv", "pools", "mamba", "usage"), "mamba num": ("kv", "pools", "mamba", "used"),
    "cpu token usage": ("kv", "pools", "cpu", "usage"),
    "#cpu-token": ("kv", "pools", "cpu", "used"), "#cpu token": ("kv", "pools", "cpu", "used"),
    "#running-req": ("queue", "running"), "#running_req": ("queue", "running"),
    "#queue-req": ("queue", "waiting"), "#remaining_req": ("queue", "waiting"),
    "#pending-token": ("pending_tokens",),
    "#unbootstrapped-req": ("unbootstrapped_requests",),
    "#transferring-req": ("transferring_requests",),
    "#bootstrap-req": ("bootstrap_requests",), "#inflight-req": ("inflight_requests",),
    "#prealloc-req": ("prealloc_requests",), "#transfer-req": ("transfer_requests",),
    "#retracted-req": ("retracted_requests",), "pre-allocated usage": ("preallocated_usage",),
    "accept len": ("accept_len",), "accept rate": ("accept_rate",),
    "gen throughput (token/s)": ("gen_throughput",),
    "input throughput (token/s)": ("input_throughput",),
}  # fmt: skip
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "context requests": ("prefill_requests",),
    "context tokens": ("prompt_tokens",),
    "generation requests": ("decode_requests",),
    "generation tokens": ("decode_tokens",),
    "iteration elapsed time": ("elapsed_ms",),
    "KV cache usage": ("kv", "usage"),
}
SEGMENT = re.compile(r"^(?P<name>[^:]+?): (?P<value>\S+?)%?$")
VLLM_SEGMENT = re.compile(
    r"^(?:(?P<value>\d+) (?P<name>[a-z ]+)|(?P<name2>.+?): (?P<value2>[\d.]+) ?(?:ms|%))$"
)


def read(path: Path) -> tuple[list[dict], Counter[str]]:
    status: Counter[str] = Counter()
    cls = SglangLogReader if path.name.startswith("sglang") else VllmLogReader
    reader = cls({}, status, lambda: 0.0)
    steps = [s.fields() for line in path.read_text().splitlines() for s in reader.feed(line)]
    return steps + [s.fields() for s in reader.flush()], status


def at(step: dict, path: tuple[str, ...]) -> Any:
    value: Any = step
    for key in path:
        value = value[key]
    return value


def check_value(step: dict, path: tuple[str, ...], text: str, percent: bool) -> None:
    got = at(step, path)
    if text in ("True", "False"):
        assert got is (text == "True")
        return
    expected = float(text) / (100.0 if percent else 1.0)
    assert got == pytest.approx(expected, abs=1e-9), f"{path}: {got} != {text}"


def sglang_segments(line: str) -> list[str]:
    m = re.search(
        r"(?:Prefill|Decode) batch(?: \[\d+\])?(?:\(mixed #running-req: \d+\))?[.,]\s*(.*)$", line
    )
    if m:
        return [s for s in re.split(r",\s+|,\s*$", m.group(1).rstrip()) if s.strip()]
    m = re.search(r"new fill batch\. (.*)$", line)
    if m:
        return [s for s in re.split(r"\.\s+|\.\s*$", m.group(1).rstrip()) if s.strip()]
    m = re.search(r"(#running-req: \d+, #token: .*)$", line)
    return [s for s in re.split(r",\s+", m.group(1).rstrip()) if s.strip()] if m else []


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=lambda n: n.replace("/", "-"))
def test_every_field_is_read_right_or_counted_as_unread(name: str) -> None:
    path = FIXTURES / name
    steps, status = read(path)
    n_steps, n_unread, n_other_ranks = EXPECTED[name]
    lines = path.read_text().splitlines()
    if n_steps < 0:
        n_steps = sum(bool(re.search(r"\bIteration\(\d+\): ", ln)) for ln in lines)
    assert len(steps) == n_steps
    assert status["unread_fields"] == n_unread == sum(len(s.get("unread", [])) for s in steps)
    assert status["other_rank_lines"] == n_other_ranks
    assert status["unreadable"] == 0
    by_iteration = {s["iteration"]: s for s in steps if "iteration" in s}
    batch_lines = (
        [ln for ln in lines if sglang_segments(ln)]
        if name.startswith("sglang")
        else [ln for ln in lines if re.search(r"\bIteration\(\d+\): ", ln)]
    )
    if name.startswith("sglang"):
        # one step per batch line, in order within a rank (repeats by other ranks left out)
        kept = [ln for ln in batch_lines if not _repeat(ln, batch_lines)]
        pairs = _pair_by_rank(kept, steps)
    else:
        pairs = [
            (ln, by_iteration[int(re.search(r"Iteration\((\d+)\)", ln).group(1))])  # type: ignore[union-attr]
            for ln in batch_lines
        ]
    for line, step in pairs:
        segments = sglang_segments(line) if name.startswith("sglang") else _vllm_segments(line)
        for seg in segments:
            seg = seg.strip()
            if seg in step.get("unread", []):
                continue  # not read, and said so
            _check_segment(step, seg, vllm=not name.startswith("sglang"))


def _check_segment(step: dict, seg: str, vllm: bool) -> None:
    if vllm:
        m = VLLM_SEGMENT.match(seg)
        assert m, f"segment {seg!r} neither read nor listed as unread"
        name = (m.group("name") or m.group("name2")).strip()
        value = m.group("value") or m.group("value2")
        if name.endswith("KV cache usage"):
            assert step["kv"]["device"] == name.split()[0]
            name = "KV cache usage"
        check_value(step, VLLM_NAMES[name], value, percent=seg.endswith("%"))
        return
    graph = re.fullmatch(r"(\w+) graph: (True|False)", seg)
    if graph:
        assert step["graph_backend"] == graph.group(1)
        check_value(step, ("graph",), graph.group(2), percent=False)
        return
    m = SEGMENT.match(seg)
    assert m and m.group("name") in SGLANG_NAMES, f"segment {seg!r} neither read nor unread"
    check_value(step, SGLANG_NAMES[m.group("name")], m.group("value"), seg.endswith("%"))


def _vllm_segments(line: str) -> list[str]:
    body = re.search(r"Iteration\(\d+\): (.*)$", line).group(1)  # type: ignore[union-attr]
    return [s for s in re.split(r",\s+", body.rstrip()) if s.strip()]


def _tags(line: str) -> tuple[str | None, tuple[str, ...]]:
    m = re.search(r"\[[\d:\-. ]+((?: [A-Z][A-Z_]*\d+)*)\]", line)
    tags = m.group(1).split() if m else []
    dp = next((t for t in tags if re.fullmatch(r"DP\d+", t)), None)
    return dp, tuple(t for t in tags if t != dp)


def _repeat(line: str, lines: list[str]) -> bool:
    """A line another rank of the same DP rank printed (not the first tag set seen for it)."""
    dp, others = _tags(line)
    first = next(_tags(ln)[1] for ln in lines if _tags(ln)[0] == dp)
    return bool(others) and others != first


def _pair_by_rank(lines: list[str], steps: list[dict]) -> list[tuple[str, dict]]:
    pairs = []
    for dp in dict.fromkeys(_tags(ln)[0] for ln in lines):
        rank = None if dp is None else int(dp[2:])
        mine = [ln for ln in lines if _tags(ln)[0] == dp]
        theirs = [s for s in steps if s.get("dp_rank") == rank]
        pairs += list(zip(mine, theirs, strict=True))
    return pairs
