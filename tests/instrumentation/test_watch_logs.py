"""The watch's log adapters on real SGLang and vLLM logs (tests/fixtures/watch, sources in
SOURCES.md): every scheduler line becomes a step, prompt tokens add up to the lines' own
`#new-token` figures, and lines it cannot read are counted, never fatal."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from websockets.sync.client import connect

from instrumentation.trace import read_jsonl
from instrumentation.watch.__main__ import main
from instrumentation.watch.logclock import LogClock, parse_stamp
from instrumentation.watch.run import Watch, WatchConfig
from instrumentation.watch.sglang_log import SglangLogReader
from instrumentation.watch.vllm_log import VllmLogReader

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "watch"
SGLANG_LOGS = sorted(FIXTURES.glob("sglang_*.log"))
# The test's own, independent reading of the fixtures: which lines are scheduler batch lines,
# and the prompt tokens each prefill line states.
BATCH_LINE = re.compile(r"(Prefill batch|Decode batch|new fill batch\.|^#running-req: )")
NEW_TOKENS = re.compile(r"#new[-_]token: (\d+)")


def convert(tmp_path: Path, source: str, log: Path, *extra: str) -> list[dict]:
    out = tmp_path / (log.stem + ".jsonl")
    assert main([source, str(log), "--trace", str(out), *extra]) == 0
    return list(read_jsonl(out))


def steps_of(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["type"] == "step"]


def read(reader_cls: type, lines: list[str], **kw: object) -> tuple[list[dict], dict, Counter]:
    engine: dict = {}
    status: Counter = Counter()
    reader = reader_cls(engine, status, lambda: 0.0, **kw)
    steps = [s.fields() for line in lines for s in reader.feed(line)]
    steps += [s.fields() for s in reader.flush()]  # the end of the input: held steps are final
    return steps, engine, status


def test_at_least_six_sglang_format_versions_are_covered() -> None:
    assert len(SGLANG_LOGS) >= 6
    sources = (FIXTURES / "SOURCES.md").read_text()
    for log in FIXTURES.glob("*.log"):
        assert f"`{log.name}`" in sources, f"{log.name} has no source in SOURCES.md"


def rank_tags(line: str) -> tuple[int | None, tuple[str, ...]]:
    """The test's own reading of a line's bracket: (DP rank, the other rank tags)."""
    m = re.search(r"\[[\d:\-. ]+((?: [A-Z][A-Z_]*\d+)*)\] ", line)
    tags = m.group(1).split() if m else []
    dp = next((int(t[2:]) for t in tags if re.fullmatch(r"DP\d+", t)), None)
    return dp, tuple(t for t in tags if not re.fullmatch(r"DP\d+", t))


def one_line_per_batch(lines: list[str]) -> dict[int | None, list[str]]:
    """Batch lines by DP rank, without the repeats other TP/PP/CP ranks print of one batch."""
    first: dict[int | None, tuple[str, ...]] = {}
    by_rank: dict[int | None, list[str]] = {}
    for line in lines:
        if not BATCH_LINE.search(line):
            continue
        dp, others = rank_tags(line)
        if first.setdefault(dp, others) == others:
            by_rank.setdefault(dp, []).append(line)
    return by_rank


@pytest.mark.parametrize("log", SGLANG_LOGS, ids=lambda p: p.stem)
def test_every_sglang_scheduler_line_becomes_a_step(tmp_path: Path, log: Path) -> None:
    by_rank = one_line_per_batch(log.read_text().splitlines())
    batch_lines = [ln for lines in by_rank.values() for ln in lines]
    messages = convert(tmp_path, "sglang-log", log)
    hello, steps = messages[0], steps_of(messages)
    assert hello["type"] == "hello" and hello["engine"]["source"] == "sglang-log"
    assert hello["engine"]["external"] is True and hello["engine"]["commands"] is False
    assert len(steps) == len(batch_lines) > 0
    assert [s["seq"] for s in steps] == list(range(len(steps)))  # v1.1: +1 per broadcast
    assert [s["step"] for s in steps] == list(range(len(steps)))
    # The prompt-token totals equal the lines' own #new-token sums.
    expected = sum(int(m.group(1)) for ln in batch_lines for m in NEW_TOKENS.finditer(ln))
    assert sum(s.get("prompt_tokens", 0) for s in steps) == expected
    for dp, lines in by_rank.items():
        rank_steps = [s for s in steps if s.get("dp_rank") == dp]
        for s, line in zip(rank_steps, lines, strict=True):  # each rank's steps in its log order
            assert s["source"] == "sglang-log" and s["items"] == []  # counts only, no ids
            assert s["phase"] == (
                "decode" if "#running-req: " in line and "#new" not in line else "prefill"
            )
            if s["phase"] == "decode":
                assert s["sample_of_steps"] == 40  # one line per --decode-log-interval steps
            assert s["t0"] <= s["t1"]
            # Stamps to the second are placed inside their second (placement.py).
            assert s["t_source"] == ("estimated" if rank_tags(line) != (None, ()) or
                                     re.search(r"\[[\d:\- ]+\] ", line) else "received")  # fmt: skip
        placed = [s["t1"] for s in rank_steps if s["t_source"] == "estimated"]
        assert len(set(placed)) == len(placed)  # never two steps of one engine at one instant
        assert placed == sorted(placed)


def test_sglang_fields_across_versions() -> None:
    steps, _, _ = read(
        SglangLogReader, (FIXTURES / "sglang_2024-04_fill_batch.log").read_text().splitlines()
    )
    assert steps[0]["cached_tokens"] == 757 and steps[0]["queue"] == {"waiting": 4, "running": 2}
    assert steps[0]["lifetime_cache_hit_rate"] == pytest.approx(0.8083)
    assert steps[-1]["phase"] == "decode" and steps[-1]["kv"] == {
        "unit": "token",
        "usage": 0.24,
        "used": 1938,
    }

    steps, _, _ = read(
        SglangLogReader, (FIXTURES / "sglang_2026-07_mamba_pending.log").read_text().splitlines()
    )
    first = steps[0]
    assert first["prefill_requests"] == 12 and first["pending_tokens"] == 109585
    assert first["kv"]["usage"] == 0.14 and first["kv"]["pools"] == {"mamba": {"usage": 0.2}}
    assert first["input_throughput"] == pytest.approx(15734.14) and first["graph"] is False
    # seconds since the first line, each step alone in its second: placed mid-second, estimated
    assert [int(s["t1"]) for s in steps] == [0, 3, 6, 9, 12]
    assert {s["t_source"] for s in steps} == {"estimated"}
    assert [s["t1"] - int(s["t1"]) for s in steps] == pytest.approx([0.4995] * 5)

    steps, _, _ = read(
        SglangLogReader,
        (FIXTURES / "sglang_2026-08_swa_chunk_end_spec_decode.log").read_text().splitlines(),
    )
    decode = steps[1]
    assert decode["kv"]["used"] == 166144 and decode["kv"]["pools"]["swa"] == {
        "used": 512,
        "usage": 0.0,
    }
    assert decode["accept_len"] == pytest.approx(3.55) and decode["accept_rate"] == pytest.approx(
        0.51
    )


def test_dp_ranks_are_kept_apart_and_selectable() -> None:
    lines = (FIXTURES / "sglang_2025-05_dp_attention.log").read_text().splitlines()
    steps, _, _ = read(SglangLogReader, lines)
    assert [s["dp_rank"] for s in steps] == [0, 6, 5, 7, 2]
    only, _, status = read(SglangLogReader, lines, dp_rank=6)
    assert [s["dp_rank"] for s in only] == [6] and status["other_dp_rank_lines"] == 4


def test_a_chunked_long_prompt_is_inferred_from_its_chunk_sized_batches() -> None:
    lines = (FIXTURES / "sglang_2026-08_swa_chunked_long_prompt.log").read_text().splitlines()
    steps, engine, _ = read(SglangLogReader, lines)
    prefills = [s for s in steps if s["phase"] == "prefill"]
    assert [s["prompt_tokens"] for s in prefills] == [256, 8192, 8192]
    assert engine["inferred_chunk_size"] == 8192  # two 8192-token batches of one request in a row
    assert prefills[-1]["budget"] == 8192 and prefills[-1]["budget_full"] is True
    assert [s["pending_tokens"] for s in prefills[1:]] == [157704, 149512]  # the prompt's rest
    # A chunk size given on the command line is used from the first line on.
    steps, _, _ = read(SglangLogReader, lines, overrides={"chunked_prefill_size": 8192})
    assert [s.get("budget_full") for s in steps if s["phase"] == "prefill"] == [False, True, True]


def test_lines_it_cannot_read_are_counted_not_fatal(tmp_path: Path) -> None:
    real = (FIXTURES / "sglang_2026-05_garbled_terminal_copy.log").read_text().splitlines()
    good = (FIXTURES / "sglang_2024-11_chunked_2048.log").read_text().splitlines()
    cut = good[0][: good[0].index("#new-token") + 6]  # a batch line cut before its token count
    noise = ["\x00\x01\xff garbage", "", "Prefill batch, ", "Decode batch. #running-req: x"]
    log = tmp_path / "mixed.log"
    log.write_text("\n".join(real + [cut] + noise + good) + "\n", encoding="utf-8")
    messages = convert(tmp_path, "sglang-log", log)
    steps = steps_of(messages)
    assert len(steps) == 6 + len(good)
    status = Counter()
    reader = SglangLogReader({}, status, lambda: 0.0)
    for line in log.read_text().splitlines():
        reader.feed(line)
    assert status["unreadable"] == 3  # the cut line, the empty prefill, the unreadable decode
    # the garbled columns of the terminal copy (12), "#new-t" and "#running-req: x"
    assert status["unread_fields"] == 14
    assert status["lines"] == len(real) + 1 + len(noise) + len(good)
    garbled = steps[1]
    assert garbled["prompt_tokens"] == 896 and "cached_tokens" not in garbled  # unknown, not 0
    assert garbled["unread"] == ["#cached-tounning-req: 45", "input th"]


def test_the_final_stderr_line_reports_what_was_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    convert(tmp_path, "sglang-log", FIXTURES / "sglang_2026-05_garbled_terminal_copy.log")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("watch: ") and "steps 6" in last and "unread_fields 12" in last


# ---- formats no pasted thread showed: lines built from SGLang's scheduler format strings ----


def test_mixed_prefill_and_forward_counter_formats() -> None:
    # scheduler.py (2024): f"Prefill batch(mixed #running-req: {num_mixed_running}). " ...
    mixed = (
        "[2024-09-01 10:00:00 TP0] Prefill batch(mixed #running-req: 3). #new-seq: 1, "
        "#new-token: 512, #cached-token: 0, cache hit rate: 0.00%, token usage: 0.02, #queue-req: 4"
    )
    # scheduler_metrics_mixin.py with SGLANG_LOG_FORWARD_ITERS: f"Prefill batch [{forward_ct + 1}], "
    counted = (
        "[2026-01-01 10:00:00 TP0] Prefill batch [57], #new-seq: 1, #new-token: 64, "
        "#cached-token: 0, token usage: 0.00, #running-req: 2, #queue-req: 0, "
    )
    steps, _, _ = read(SglangLogReader, [mixed, counted])
    assert steps[0]["phase"] == "mixed" and steps[0]["decode_requests"] == 3
    assert steps[0]["queue"] == {"waiting": 4, "running": 3} and steps[0]["prompt_tokens"] == 512
    assert steps[1]["iteration"] == 57 and steps[1]["phase"] == "prefill"


def test_start_up_lines_fill_the_engine_facts() -> None:
    # shapes of SGLang's start-up lines: the ServerArgs dump and the memory-pool summary
    lines = [
        "[2025-01-01 12:00:00] server_args=ServerArgs(model_path='Qwen/Qwen2.5-7B', "
        "chunked_prefill_size=4096, decode_log_interval=10, page_size=1, tp_size=1)",
        "[2025-01-01 12:00:05 TP0] max_total_num_tokens=100000, chunked_prefill_size=4096, "
        "max_prefill_tokens=16384, max_running_requests=2048, context_len=32768",
        "[2025-01-01 12:00:09 TP0] Prefill batch. #new-seq: 1, #new-token: 4096, #cached-token: 0, "
        "token usage: 0.25, #running-req: 0, #queue-req: 0",
        "[2025-01-01 12:00:10 TP0] Decode batch. #running-req: 1, #token: 4200, token usage: 0.04, "
        "gen throughput (token/s): 50.00, #queue-req: 0",
    ]
    steps, engine, _ = read(SglangLogReader, lines)
    assert engine["model"] == "Qwen/Qwen2.5-7B" and engine["max_total_num_tokens"] == 100000
    assert engine["decode_log_interval"] == 10 and "decode_log_interval_source" not in engine
    assert steps[0]["budget"] == 4096 and steps[0]["budget_full"] is True
    assert steps[0]["kv"] == {
        "unit": "token",
        "usage": 0.25,
        "used": 25000,
        "approx": True,
        "total": 100000,
    }
    assert steps[1]["kv"]["used"] == 4200 and steps[1]["sample_of_steps"] == 10


def test_other_tp_ranks_repeating_a_batch_are_not_counted_twice() -> None:
    line = "[2025-01-01 12:00:00 {}] Decode batch. #running-req: 2, #token: 10, token usage: 0.00, #queue-req: 0"
    steps, _, status = read(SglangLogReader, [line.format("TP0"), line.format("TP1")])
    assert len(steps) == 1 and status["other_rank_lines"] == 1


def test_time_only_stamps_roll_over_midnight() -> None:
    clock = LogClock()
    assert clock.seconds(*parse_stamp(None, "23:59:59")) == 0.0
    assert clock.seconds(*parse_stamp(None, "00:00:01")) == 2.0


# ---- vLLM ----


def test_vllm_iteration_lines_become_steps(tmp_path: Path) -> None:
    log = FIXTURES / "vllm_2025-12_iteration_details.log"
    steps = steps_of(convert(tmp_path, "vllm-log", log))
    assert [s["iteration"] for s in steps] == [515, 516, 517]
    for s in steps:
        assert s["phase"] == "decode" and s["decode_requests"] == 20 and s["decode_tokens"] == 20
        assert s["prompt_tokens"] == 0 and s["dp_rank"] == 0 and s["t_source"] == "estimated"
    # Three steps logged in one second: spread inside it, in order, each its elapsed time long.
    assert [round(s["t1"] - s["t0"], 5) for s in steps] == [0.01099, 0.01095, 0.01079]
    assert (
        0 < steps[0]["t1"] < steps[1]["t0"] < steps[1]["t1"] < steps[2]["t0"] < steps[2]["t1"] < 1
    )


def test_vllm_other_lines_are_skipped_and_newer_fields_read() -> None:
    junk = (FIXTURES / "vllm_2025-12_stat_logger_lines.log").read_text().splitlines()
    # the front-end logger's line (vLLM #46647): the same fields, then KV usage and encoder counts
    newer = (
        "(APIServer pid=7) INFO 06-24 10:00:00 [loggers.py:200] Iteration(10): 2 context requests, "
        "300 context tokens, 5 generation requests, 5 generation tokens, iteration elapsed time: "
        "20.00 ms, GPU KV cache usage: 12.5%, encoder inputs: 4, encoder output embeddings: 3520"
    )
    steps, _, status = read(
        VllmLogReader, [*junk, newer, newer.replace("Iteration(10): 2", "Iteration(11): x")]
    )
    assert status["skipped"] == len(junk) and status["unreadable"] == 1
    (s,) = steps
    assert s["phase"] == "mixed" and s["prompt_tokens"] == 300 and s["prefill_requests"] == 2
    assert s["kv"] == {"unit": "block", "device": "GPU", "usage": 0.125}
    assert s["encoder_output_embeddings"] == 3520


# ---- reading modes ----


def test_stdin_is_read_with_a_dash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    log = FIXTURES / "sglang_2024-10_tqdm_interleaved.log"
    monkeypatch.setattr("sys.stdin", io.StringIO(log.read_text()))
    out = tmp_path / "stdin.jsonl"
    assert main(["sglang-log", "-", "--trace", str(out)]) == 0
    assert len(steps_of(list(read_jsonl(out)))) == 7


def test_follow_serves_steps_as_the_log_grows(tmp_path: Path) -> None:
    lines = (FIXTURES / "sglang_2026-04_http_interleaved.log").read_text().splitlines(keepends=True)
    log = tmp_path / "server.log"
    log.write_text("".join(lines[:3]))  # a decode and a prefill line so far
    watch = Watch(WatchConfig(source="sglang-log", target=str(log), follow=True, port=0))
    runner = threading.Thread(target=watch.run, daemon=True)
    runner.start()
    try:
        assert watch.served.wait(10) and watch.url
        with connect(watch.url, open_timeout=10) as ws:
            hello = json.loads(ws.recv(timeout=10))
            assert (
                hello["type"] == "hello" and hello["engine"]["instance"] == watch.emitter.instance
            )
            seen = list(hello["history"]["steps"])
            with log.open("a") as f:  # the server writes more, the last line in two pieces
                f.write("".join(lines[3:-1]) + lines[-1][:10])
                f.flush()
                f.write(lines[-1][10:] + lines[2])
            while len(seen) < 5:
                msg = json.loads(ws.recv(timeout=10))
                if msg["type"] == "step":
                    seen.append(msg)
        assert [s["phase"] for s in seen] == ["decode", "prefill", "prefill", "prefill", "prefill"]
        assert [s["seq"] for s in seen] == list(range(5))
        assert hello["seq"] == len(hello["history"]["steps"]) - 1
    finally:
        watch.stop.set()
        runner.join(10)


def test_a_served_log_refuses_commands_with_the_reason() -> None:
    log = FIXTURES / "sglang_2024-11_chunked_2048.log"
    watch = Watch(WatchConfig(source="sglang-log", target=str(log), port=0, engine={"model": "m"}))
    runner = threading.Thread(target=watch.run, daemon=True)
    runner.start()
    try:
        assert watch.served.wait(10) and watch.url
        deadline = time.monotonic() + 10
        while watch.emitter.delivered < 7 and time.monotonic() < deadline:
            time.sleep(0.02)
        with connect(watch.url, open_timeout=10) as ws:
            hello = json.loads(ws.recv(timeout=10))
            ws.send(json.dumps({"type": "submit", "id": "a1", "prompt": "hi"}))
            refused = json.loads(ws.recv(timeout=10))
            ws.send(json.dumps({"type": "stats", "id": "s1"}))
            stats = json.loads(ws.recv(timeout=10))
    finally:
        watch.stop.set()
        runner.join(10)
    assert (
        len(hello["history"]["steps"]) == 7 and hello["seq"] == 6
    )  # the whole log, for a late page
    assert hello["engine"]["model"] == "m" and hello["engine"]["commands"] is False
    assert refused["type"] == "error" and refused["id"] == "a1"
    assert refused["message"] == hello["engine"]["commands_reason"]
    assert stats["type"] == "stats" and stats["id"] == "s1" and stats["steps"] == 7


def test_the_command_line_refuses_a_watch_with_nothing_to_do() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sglang-log", str(FIXTURES / "sglang_2024-11_chunked_2048.log")])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["vllm-fpm", "tcp://127.0.0.1:1", "--port", "0", "--follow"])


def test_pace_replays_a_log_in_order(tmp_path: Path) -> None:
    out = tmp_path / "paced.jsonl"
    log = FIXTURES / "sglang_2024-08_decode_time_only.log"
    assert main(["sglang-log", str(log), "--trace", str(out), "--pace", "1000"]) == 0
    steps = steps_of(list(read_jsonl(out)))
    assert [s["t1"] for s in steps] == sorted(s["t1"] for s in steps) and len(steps) == 10
