"""The sweep: workloads (Poisson and trace replay, scaled), one trace per (policy, budget) in
the server's `--trace` format, and a summary table that the traces alone reproduce."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from engine.workload import (
    AZURE_CODE,
    AZURE_CONV,
    Scaling,
    TraceRow,
    poisson,
    read_trace,
    replay,
    trace_rate,
)
from instrumentation.sweep import COLUMNS, read_summary, summarize_folder
from instrumentation.trace import read_jsonl
from tests.server.test_server_support import child_env

# One xdist worker runs this module, so its module-scoped sweep is set up once (tests spread
# over both workers had each worker set up its own).
pytestmark = pytest.mark.xdist_group("test_sweep")

BUDGETS = (16, 64)
POLICIES = ("prefill_first", "mixed")


# ---- workloads ----------------------------------------------------------------------------------


def test_the_bundled_azure_traces_parse() -> None:
    conv, code = read_trace(AZURE_CONV), read_trace(AZURE_CODE)
    assert len(conv) == 19366 and len(code) == 8819
    assert conv[0].t == 0.0 and all(a.t <= b.t for a, b in zip(conv, conv[1:], strict=False))
    # the conversation trace: about 5.5 requests a second over its hour
    assert 4.0 < trace_rate(conv) < 7.0
    assert conv[0] == TraceRow(0.0, 374, 44)


def test_scaling_multiplies_rounds_and_clamps() -> None:
    s = Scaling(length_scale=0.125, max_prompt=300, max_output=50, max_seq_len=320)
    assert s.apply(1020, 129) == (128, 16)
    assert s.apply(4, 3) == (1, 1)  # never below one token
    assert s.apply(8000, 1000) == (270, 50)  # prompt clamped to fit max_seq_len with the output
    with pytest.raises(ValueError):
        Scaling(length_scale=0)


def test_poisson_is_seeded_and_has_its_rate() -> None:
    lengths = read_trace(AZURE_CONV)
    a = poisson(4.0, 500.0, lengths, Scaling(0.5), seed=3)
    assert a == poisson(4.0, 500.0, lengths, Scaling(0.5), seed=3)
    assert a != poisson(4.0, 500.0, lengths, Scaling(0.5), seed=4)
    assert 1700 < len(a) < 2300  # 2000 expected; the spread of a Poisson count is ~45
    assert all(0 <= x.t < 500 for x in a)
    pairs = {(r.context_tokens, r.generated_tokens) for r in lengths}
    # every length pair is a (scaled) pair of the trace
    scaled = {Scaling(0.5).apply(c, g) for c, g in pairs}
    assert all((x.prompt_len, x.output_len) in scaled for x in a)


def test_replay_keeps_the_trace_shape_and_rescales_its_clock() -> None:
    rows = read_trace(AZURE_CONV)
    same = replay(rows, start=100, limit=50)
    assert [a.t for a in same] == pytest.approx([r.t - rows[100].t for r in rows[100:150]])
    assert [(a.prompt_len, a.output_len) for a in same] == [
        (r.context_tokens, r.generated_tokens) for r in rows[100:150]
    ]
    slow = replay(rows, rate=0.5, duration=60.0, start=100)
    gaps = [b.t - a.t for a, b in zip(slow, slow[1:], strict=False)]
    orig = [b.t - a.t for a, b in zip(rows[100:], rows[101:], strict=False)][: len(gaps)]
    factor = gaps[0] / orig[0]
    assert all(g == pytest.approx(o * factor) for g, o in zip(gaps, orig, strict=True))
    assert 15 <= len(slow) <= 60 and slow[-1].t < 60.0  # ~30 at 0.5/s over 60 s


# ---- the sweep on a tiny random model -----------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    # the command the docs give (python -m bench.sweep), run as a user runs it: a test imports
    # no tool
    subprocess.run(
        [sys.executable, "-m", "bench.sweep", "--model", str(tiny_llama_dir), "--device", "cpu",
         "--budgets", ",".join(map(str, BUDGETS)), "--policies", ",".join(POLICIES),
         "--out", str(out), "--rate", "20", "--duration", "0.4", "--length-scale", "0.05",
         "--max-prompt", "96", "--max-output", "8", "--seed", "5", "--no-png"],
        cwd=Path(__file__).resolve().parents[2], check=True, env=child_env(),
    )  # fmt: skip
    return out


def _runs(out: Path) -> dict[tuple[str, int], list[dict]]:
    return {(p, b): list(read_jsonl(out / f"{p}-{b}.jsonl")) for p in POLICIES for b in BUDGETS}


def test_every_run_is_a_server_trace_of_the_same_workload(sweep_dir: Path) -> None:
    runs = _runs(sweep_dir)
    queued_shapes = set()
    for (policy, budget), msgs in runs.items():
        hello = msgs[0]
        assert hello["type"] == "hello" and hello["seq"] == -1
        assert hello["config"] == {
            "max_extend_tokens": budget,
            "policy": policy,
            "admission": "reserve",
        }
        assert hello["engine"]["instance"]
        seqs = [m["seq"] for m in msgs[1:]]
        assert seqs == list(range(len(seqs)))  # every broadcast, numbered as the publisher does
        steps = [m for m in msgs if m["type"] == "step"]
        assert steps and all(s["policy"] == policy and s["budget"] == budget for s in steps)
        for s in steps:  # the budget bounds each step's prompt tokens
            prompt = sum(i["end"] - i["start"] for i in s["items"] if i["kind"] != "decode")
            assert prompt <= budget
        if policy == "prefill_first":
            assert all(s["phase"] != "mixed" for s in steps)
        queued = {m["uid"]: m for m in msgs if m.get("event") == "queued"}
        finished = {m["uid"]: m for m in msgs if m.get("event") == "finished"}
        assert finished.keys() == queued.keys() and len(queued) >= 4
        # EOS ignored: every request produced the trace's (scaled) output length
        assert all(finished[u]["output_len"] == q["max_tokens"] for u, q in queued.items())
        queued_shapes.add(tuple((q["prompt_len"], q["max_tokens"]) for q in queued.values()))
    assert len(queued_shapes) == 1  # the same requests in every run


def test_summary_is_recomputed_from_the_traces(sweep_dir: Path) -> None:
    with (sweep_dir / "summary.csv").open() as f:
        assert tuple(next(csv.reader(f))) == COLUMNS
    table = read_summary(sweep_dir / "summary.csv")
    assert {(r.policy, r.budget) for r in table} == {(p, b) for p in POLICIES for b in BUDGETS}
    # every number of the table, from the JSONL files alone (floats are written exactly)
    assert sorted(summarize_folder(sweep_dir), key=repr) == sorted(table, key=repr)
    # mixed decodes every running request in every step: it never stalls; prefill-first does
    assert all(r.worst_stall_s is None for r in table if r.policy == "mixed")
    assert any(r.worst_stall_s is not None for r in table if r.policy == "prefill_first")
    html = (sweep_dir / "tradeoff.html").read_text()
    assert "ITL p99" in html and "mixed-64.jsonl" in html  # the points name their runs


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the two nearest ranks (numpy's default), by hand."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def test_one_rows_itl_p99_by_hand(sweep_dir: Path) -> None:
    row = next(r for r in read_summary(sweep_dir / "summary.csv") if r.policy == "prefill_first"
               and r.budget == BUDGETS[0])  # fmt: skip
    times: dict[int, list[float]] = defaultdict(list)
    with (sweep_dir / f"prefill_first-{BUDGETS[0]}.jsonl").open() as f:
        for line in f:
            msg = json.loads(line)
            if msg["type"] == "token":
                times[msg["uid"]].append(msg["t"])
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:], strict=False)]
    assert len(gaps) > 10
    assert row.itl_p99_s == pytest.approx(_percentile(gaps, 99), rel=1e-12)
    assert row.requests == len(times)


def test_the_summary_cli_rewrites_the_table_from_the_traces(
    sweep_dir: Path, tmp_path: Path
) -> None:
    from instrumentation.sweep import main

    for p in sweep_dir.glob("*.jsonl"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    assert main([str(tmp_path), "--no-png"]) == 0
    assert sorted(read_summary(tmp_path / "summary.csv"), key=repr) == sorted(
        read_summary(sweep_dir / "summary.csv"), key=repr
    )
    assert (tmp_path / "tradeoff.html").exists()
    assert main([str(tmp_path / "nothing-here"), "--no-png"]) == 1
