"""The watch against a live vLLM, and the recorder of the CI capture.

Opt-in: vLLM's CPU wheel and its dependencies are 3.5 GB, so this runs only with
STEPSCOPE_VLLM_VENV pointing at a venv that has it (`bash scripts/setup_vllm.sh` makes one;
see docs/watch.md). It starts vLLM 0.32 on the bundled SmolLM2 with iteration details and
KV events (PUB bound on a free port, with its replay socket), a log watch (with the KV events)
and a KV-events watch, each serving over WebSocket with a trace, sends a few short prompts and
one long one (then the long one again: a prefix-cache hit), and checks: one step per iteration
line, every step with its KV usage, no two steps of one engine at one time, the prompt tokens
equal to vLLM's own /metrics delta, KV events read, and both traces complete after SIGTERM.

`python -m tests.instrumentation.test_watch_vllm_live --record DIR` runs the same load and keeps
what vLLM printed and published (the log, the raw KV-event frames, the version and the command)
in DIR: that is how tests/fixtures/watch/vllm_0.32_cpu_capture was made.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.server.test_server_support import child_env

ROOT = Path(__file__).resolve().parents[2]
VENV = os.environ.get("STEPSCOPE_VLLM_VENV", "")
READY_TIMEOUT_S = 900  # a cold start on a busy 2-core machine
MODEL_NAME = "SmolLM2-135M-Instruct"
SHORT_PROMPTS = (
    "Name three colours of the rainbow and say which one has the longest wavelength of all.",
    "Write one sentence about a lighthouse keeper who collects old maps of the northern sea.",
    "List four vegetables that grow well in cold climates and explain why in a few words each.",
)
# About 1,360 tokens: three prefill chunks at --max-num-batched-tokens 512.
LONG_PROMPT = " ".join(
    f"Paragraph {i}: the river carried timber from the hills to the mill, and the miller kept a "
    f"ledger of every log, its length, its wood and the day it arrived."
    for i in range(36)
)
HITS = {"kv_cache_report_mode": "full"}  # vLLM then announces prefix-cache hits as KV events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Ports:
    api: int = field(default_factory=free_port)
    kv: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)


def vllm_command(python: str, model_dir: str, ports: Ports) -> list[str]:
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports.kv}",  # vLLM binds: the watch connects
        "replay_endpoint": f"tcp://*:{ports.replay}",
    }
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(ports.api),
        "--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
        "--optimization-level", "0",  # no torch.compile: starts in minutes on a laptop CPU
        "--enable-logging-iteration-details",
        "--kv-events-config", json.dumps(kv),
    ]  # fmt: skip


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TZ": "UTC"}  # fmt: skip


@contextlib.contextmanager
def running_vllm(python: str, model_dir: str, ports: Ports, log: Path) -> Iterator[str]:
    url = f"http://127.0.0.1:{ports.api}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            vllm_command(python, model_dir, ports),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **VLLM_ENV},
            start_new_session=True,  # its engine-core and worker processes stop with it
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({proc.returncode}); see {log}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not ready after {READY_TIMEOUT_S} s; see {log}")
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def metrics(url: str) -> dict[str, float]:
    """vLLM's /metrics counters, summed over engines: name{source=..} kept apart."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"(vllm:[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+)$", line)
        if not m:
            continue
        source = re.search(r'source="([^"]+)"', m.group(2) or "")
        name = m.group(1) + (f"[{source.group(1)}]" if source else "")
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    # ignore_eos: every request decodes its max_tokens (SmolLM2 may end a raw prompt at once)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "vllm_xargs": HITS}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def send_load(url: str) -> None:
    """A few short prompts at once, then one long prompt, then the long prompt again."""
    with ThreadPoolExecutor(len(SHORT_PROMPTS)) as pool:
        list(pool.map(lambda p: complete(url, p, 8), SHORT_PROMPTS))
    complete(url, LONG_PROMPT, 4)
    complete(url, LONG_PROMPT, 4)  # its prefix is cached now: reuse announced as KV events


# ---- the watches, as a user runs them ----


@dataclass
class RunningWatch:
    proc: subprocess.Popen[str]
    url: str
    received: list[dict] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@contextlib.contextmanager
def running_watch(*args: str) -> Iterator[RunningWatch]:
    argv = [sys.executable, "-m", "instrumentation.watch", *args, "--port", "0"]
    env = child_env(PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    url = ""
    for line in proc.stderr:
        if "watch: serving ws://" in line:
            url = line[line.index("ws://") :].strip()
            break
    assert url, "the watch exited before serving"
    watch = RunningWatch(proc, url)
    threading.Thread(target=lambda: watch.stderr.extend(proc.stderr or []), daemon=True).start()
    client = threading.Thread(target=_collect, args=(watch,), daemon=True)
    client.start()
    try:
        yield watch
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _collect(watch: RunningWatch) -> None:
    """A WebSocket client: every message the watch served to it."""
    from websockets.sync.client import connect

    with contextlib.suppress(Exception), connect(watch.url, open_timeout=30) as ws:
        for frame in ws:
            watch.received.append(json.loads(frame))


def iteration_lines(log: Path) -> list[str]:
    """The test's own reading: vLLM's iteration lines that are steps (not DP idle steps)."""
    lines = log.read_text(errors="replace").splitlines()
    return [ln for ln in lines if re.search(r"\bIteration\(\d+\): ", ln) and "(dummy)" not in ln]


def wait_for(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


# ---- the test ----


def vllm_python() -> str:
    python = Path(VENV) / "bin" / "python"
    if not VENV or not python.is_file():
        pytest.skip("set STEPSCOPE_VLLM_VENV to a venv with vllm-cpu 0.32 (docs/watch.md)")
    return str(python)


def bundled_model_dir() -> str:
    from engine.models.loader import resolve  # converts the bundled GGUF once

    return str(resolve("smollm2", progress=False).path)


@pytest.mark.vllm
def test_the_watch_reads_a_live_vllm_completely(tmp_path: Path) -> None:
    python, model_dir, ports = vllm_python(), bundled_model_dir(), Ports()
    log = tmp_path / "vllm.log"
    log_trace, kv_trace = tmp_path / "log.jsonl", tmp_path / "kv.jsonl"
    kv_endpoint = f"tcp://127.0.0.1:{ports.kv}"
    replay_endpoint = f"tcp://127.0.0.1:{ports.replay}"
    with running_vllm(python, model_dir, ports, log) as url:
        before = metrics(url)
        with (
            running_watch("vllm-log", str(log), "--follow", "--trace", str(log_trace),
                          "--kv-events", kv_endpoint, "--kv-replay", replay_endpoint,
                          "--log-timezone", "UTC") as log_watch,
            running_watch("vllm-kv-events", kv_endpoint, "--kv-replay", replay_endpoint,
                          "--trace", str(kv_trace)) as kv_watch,
        ):  # fmt: skip
            send_load(url)
            after = metrics(url)
            lines = iteration_lines(log)
            wait_for(
                lambda: sum(m["type"] == "step" for m in log_watch.received) >= len(lines),
                60,
                "every iteration line to be served",
            )
            wait_for(lambda: bool(kv_watch.received[1:]), 30, "KV events")
            for watch in (log_watch, kv_watch):
                watch.proc.send_signal(signal.SIGTERM)
                assert watch.proc.wait(30) == 0
    steps = [m for m in log_watch.received if m["type"] == "step"]
    # One step per iteration line, each with its KV usage, in each engine's order.
    assert len(steps) == len(lines) > 10
    assert [s["iteration"] for s in steps] == [
        int(re.search(r"Iteration\((\d+)\)", ln).group(1))
        for ln in lines  # type: ignore[union-attr]
    ]
    assert all(s["kv"]["device"] == "CPU" and 0 <= s["kv"]["usage"] <= 1 for s in steps)
    # No two steps of one engine at one time: the log's stamps are whole seconds.
    for rank in {s.get("dp_rank") for s in steps}:
        ends = [s["t1"] for s in steps if s.get("dp_rank") == rank]
        assert len(set(ends)) == len(ends) and ends == sorted(ends)
    assert {s["t_source"] for s in steps} == {"estimated"}
    # The prompt tokens computed are what vLLM counted (its prefix-cache hits are not computed).
    computed = after["vllm:prompt_tokens_by_source_total[local_compute]"] - before.get(
        "vllm:prompt_tokens_by_source_total[local_compute]", 0.0
    )
    total = after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0.0)
    cached = after.get("vllm:prompt_tokens_cached_total", 0.0) - before.get(
        "vllm:prompt_tokens_cached_total", 0.0
    )
    assert sum(s["prompt_tokens"] for s in steps) == computed == total - cached > 1000
    # KV events read: blocks stored by the long prompt, its second run announced as reuse.
    kv = [m for m in kv_watch.received if m["type"] == "kv_events"]
    assert kv and sum(m["stored_blocks"] for m in kv) > 0 and sum(m["reused_blocks"] for m in kv)
    # Both traces hold every message served, after SIGTERM.
    for watch, trace in ((log_watch, log_trace), (kv_watch, kv_trace)):
        written = [json.loads(line) for line in trace.read_text().splitlines()]
        served = [m for m in watch.received if m["type"] != "hello"]
        assert [m for m in written if m["type"] != "hello"][: len(served)] == served
        assert any("watch: " in line for line in watch.stderr)  # the closing summary line
    print(
        f"\nlive vLLM: {len(lines)} iteration lines -> {len(steps)} steps, prompt tokens "
        f"{sum(s['prompt_tokens'] for s in steps)} = /metrics local_compute {computed:.0f} "
        f"(total {total:.0f} - cached {cached:.0f}); {len(kv)} KV batches, "
        f"{sum(m['stored_blocks'] for m in kv)} blocks stored, "
        f"{sum(m['reused_blocks'] for m in kv)} reused; traces after SIGTERM: "
        f"{len(log_trace.read_text().splitlines())} and {len(kv_trace.read_text().splitlines())} lines"
    )


# ---- recording the CI capture ----


def record(out: Path, python: str, model_dir: str) -> None:
    """Run the load against a fresh vLLM and keep its log and raw KV-event frames in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    ports = Ports()
    log, frames = out / "vllm.log", out / "kv_events.frames"
    with running_vllm(python, model_dir, ports, log) as url:
        kv = f"tcp://127.0.0.1:{ports.kv}"
        before = metrics(url)
        with running_watch("vllm-kv-events", kv, "--record-frames", str(frames)) as watch:
            time.sleep(1)  # the subscription is in place before the first batch
            send_load(url)
            time.sleep(2)
            after = metrics(url)
            watch.proc.send_signal(signal.SIGTERM)
            watch.proc.wait(30)
        version = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
        ).stdout.strip()
    delta = {k: after[k] - before.get(k, 0.0) for k in sorted(after) if k.endswith("_total") or
             k.endswith("_total[local_compute]") or k.endswith("_total[local_cache_hit]")}  # fmt: skip
    (out / "metrics_delta.json").write_text(json.dumps(delta, indent=1, sort_keys=True) + "\n")
    command = shlex.join(vllm_command("python", "MODEL_DIR", ports))
    env = " ".join(f"{k}={v}" for k, v in VLLM_ENV.items())
    (out / "CAPTURE.md").write_text(
        f"# vLLM {version} on CPU, recorded for the watch's replay test\n\n"
        f"Made by `python -m tests.instrumentation.test_watch_vllm_live --record {out}` on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())} (2 shared cores), with the KV-event frames "
        "kept by `python -m instrumentation.watch vllm-kv-events tcp://127.0.0.1:PORT "
        "--record-frames kv_events.frames`.\n\nvLLM was started as:\n\n"
        f"```\n{env} {command}\n```\n\n"
        "MODEL_DIR is the bundled SmolLM2-135M-Instruct converted to safetensors "
        "(`engine.models.loader.resolve('smollm2')`). The load: three short prompts at once "
        "(8 tokens each), one long prompt of about 1,360 tokens (4 tokens), then the long prompt "
        'again, all greedy with `ignore_eos` and `vllm_xargs: {"kv_cache_report_mode": "full"}`.'
        " `metrics_delta.json`: vLLM's own /metrics counters, after the load minus before.\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", required=True, metavar="DIR")
    args = parser.parse_args()
    record(Path(args.record), vllm_python(), bundled_model_dir())


@pytest.mark.vllm
def test_the_documented_millisecond_log_config_gives_millisecond_steps(tmp_path: Path) -> None:
    """docs/watch.md's logging config, applied by vLLM itself, stamps lines the watch reads to
    the millisecond (`t_source: "log"`)."""
    python = vllm_python()
    doc = (ROOT / "docs" / "watch.md").read_text()
    config = re.search(r"cat > vllm-logging\.json <<'EOF'\n(.*?)\nEOF", doc, re.S)
    assert config, "docs/watch.md lost its vLLM logging config"
    path = tmp_path / "vllm-logging.json"
    path.write_text(config.group(1))
    # vLLM's own logger, configured from the environment as its processes are, printing
    # iteration lines with its own format string
    script = (
        "import vllm.logger as L\n"
        "L._configure_vllm_root_logger()\n"
        "log = L.init_logger('vllm.v1.metrics.loggers')\n"
        "for i in range(3):\n"
        "    log.info('%sIteration(%d): %d context requests, %d context tokens, %d generation "
        "requests, %d generation tokens, iteration elapsed time: %.2f ms%s, %s KV cache usage: "
        "%.1f%%%s', 'Engine 000: ', i, 0, 0, 2, 2, 1.5, '', 'CPU', 0.5, '')\n"
    )
    out = subprocess.run(
        [python, "-c", script], capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(path)},
    )  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if "Iteration(" in ln]
    assert len(lines) == 3, out.stdout + out.stderr
    from collections import Counter

    from instrumentation.watch.vllm_log import VllmLogReader

    reader = VllmLogReader({}, Counter(), lambda: 0.0)
    steps = [s for line in lines for s in reader.feed(line)] + reader.flush()
    assert [s.t_source for s in steps] == ["log"] * 3
    assert [s.kv for s in steps] == [{"unit": "block", "device": "CPU", "usage": 0.005}] * 3
