"""vLLM's iteration log (`--enable-logging-iteration-details`) → aggregate steps.

With that flag vLLM logs one line per engine step (tests/fixtures/watch/SOURCES.md). Up to
0.2x the engine core printed it; from the front-end logger (vLLM #46647, 0.32) the API server
prints it, with the engine's index and the KV usage of its device:

    (EngineCore_DP0 pid=2010410) INFO 12-22 21:44:40 [core.py:349] Iteration(515): 0 context
    requests, 0 context tokens, 20 generation requests, 20 generation tokens, iteration elapsed
    time: 10.99 ms
    (APIServer pid=18355) INFO 12-02 10:51:05 [loggers.py:200] Engine 000: Iteration(25): 1
    context requests, 512 context tokens, 0 generation requests, 0 generation tokens, iteration
    elapsed time: 31.20 ms, CPU KV cache usage: 3.2%

A context request has produced no output token yet (a prompt, or a chunk of one); its tokens
are the prompt tokens computed this step. The KV device is whatever vLLM runs on (GPU, CPU, XPU,
TPU, ...). `Engine NNN` (or `EngineCore_DPn`) is the data-parallel rank: each rank is its own
engine with its own iteration counter, so each is its own stream of steps. A DP rank's idle
step is logged with `(dummy)` and no work: counted, not a step. Any process tag may come first
(`(APIServer pid=…)`, `(EngineCore_DP1 pid=…)`, a Ray actor's `(RayWorkerWrapper pid=…, ip=…)`).

Times: vLLM's stamps have no year and, by default, whole seconds; placement.py turns them into
honest step times (docs/watch.md says how to get millisecond stamps). The elapsed time is how
long the engine waited for the step's result (with async scheduling, only that wait), so a step
spans [t1 − elapsed, t1]. Other lines (start-up, stat loggers, access logs) are skipped; the
start-up lines fill hello.engine with what they state (model, pool size).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from instrumentation.watch.aggregate import AggregateStep
from instrumentation.watch.fields import Field, FieldTable, read_segments, split_body
from instrumentation.watch.fields import field as f
from instrumentation.watch.logclock import LogClock, parse_month_day
from instrumentation.watch.placement import StepPlacer

SOURCE = "vllm-log"

ITERATION = re.compile(
    r"(?:\bEngine (?P<engine>\d+): )?\bIteration\((?P<iteration>\d+)\):\s*(?P<body>.*)$"
)
PROC = re.compile(r"\((?P<proc>[^()\s]+) pid=\d+(?:, ip=[^()]*)?\)")
DP_OF_PROC = re.compile(r"_DP(\d+)$")
STAMP = re.compile(
    r"(?:(?P<year>\d{4})-)?(?P<md>\d{2}-\d{2})[ T](?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d+))?"
)


def _elapsed(ms: str, dummy: str | None) -> tuple[float, bool]:
    return float(ms), dummy is not None


def _device_usage(device: str, pct: str) -> tuple[str, float]:
    return device, float(pct) / 100.0


def _kv_blocks(pct: str, used: str, total: str, tokens: str) -> dict[str, Any]:
    return {"usage": float(pct) / 100.0, "used": int(used), "total": int(total),
            "tokens": int(tokens)}  # fmt: skip


FIELDS = FieldTable(
    {
        "context_requests": f(r"(\d+) context requests"),
        "context_tokens": f(r"(\d+) context tokens"),
        "generation_requests": f(r"(\d+) generation requests"),
        "generation_tokens": f(r"(\d+) generation tokens"),
        "elapsed": f(r"iteration elapsed time: ([\d.]+) ?ms( \(dummy\))?", _elapsed),
        "device_usage": f(r"(\S+) KV cache usage: ([\d.]+)%", _device_usage),
        # vLLM #34860 (a variant some builds carry): `kv cache: 5.1% (3500/68959 blocks, ...)`
        "kv_blocks": f(r"kv cache: ([\d.]+)% \((\d+)/(\d+) blocks, (\d+) tokens\)", _kv_blocks),
        "encoder_inputs": f(r"encoder inputs: (\d+)"),
        "encoder_output_embeddings": f(r"encoder output embeddings: (\d+)"),
    }
)
REQUIRED = ("context_requests", "context_tokens", "generation_requests")
# Start-up lines: what they state about the engine, into hello.engine.
ENGINE_INFO: dict[str, Field] = {
    "vllm_version": f(r"\bversion (\d+\.\d+\.\S+)", str),
    "model": f(r"\bserved_model_name': \['([^']+)'", str),
    "max_model_len": f(r"\bUsing max model len (\d+)"),
    "max_num_batched_tokens": f(r"\bmax_num_batched_tokens=(\d+)"),
    "kv_cache_tokens": f(
        r"\b[A-Z]+ KV cache size: ([\d,]+) tokens", lambda s: int(s.replace(",", ""))
    ),
    "num_gpu_blocks": f(r"\bnum_gpu_blocks is: (\d+)"),
}


@dataclass
class VllmLogReader:
    engine: dict[str, Any]
    status: Counter[str]
    now: Callable[[], float]
    dp_rank: int | None = None
    clock: LogClock = field(default_factory=LogClock)
    placer: StepPlacer = field(default_factory=StepPlacer)

    def feed(self, line: str) -> list[AggregateStep]:
        self.status["lines"] += 1
        line = line.rstrip("\r\n")
        m = ITERATION.search(line)
        prefix = line[: m.start()] if m else line[:80]
        stamp = _last(STAMP, prefix)
        placed: list[AggregateStep] = []
        if m is None:
            self.status["skipped"] += 1
            self._engine_info(line)
            if stamp is not None:  # any stamped line: the log has reached this time
                placed = self.placer.advance(self._seconds(stamp))
            return placed
        dp = self._rank(m, prefix)
        if self.dp_rank is not None and dp != self.dp_rank:
            self.status["other_dp_rank_lines"] += 1
            return []
        reading = read_segments(split_body(m.group("body")), FIELDS)
        v = reading.values
        if any(k not in v for k in REQUIRED):
            self.status["unreadable"] += 1
            return []
        if reading.unread:
            self.status["unread_fields"] += len(reading.unread)
        elapsed_ms, dummy = v.get("elapsed", (None, False))
        ctx_tokens, gen_requests = v["context_tokens"], v["generation_requests"]
        if dummy or (ctx_tokens == 0 and gen_requests == 0):  # a data-parallel idle step
            self.status["idle_iterations"] += 1
            return []
        if stamp is not None:
            t1, t_source = self._seconds(stamp), "log"
            placed = self.placer.advance(t1)
        else:
            t1, t_source = self.now(), "received"
        duration = elapsed_ms / 1000.0 if elapsed_ms is not None else 0.0
        step = AggregateStep(
            source=SOURCE,
            phase="mixed"
            if ctx_tokens and gen_requests
            else ("prefill" if ctx_tokens else "decode"),
            t0=t1 - duration,
            t1=t1,
            t_source=t_source,  # type: ignore[arg-type]
            prompt_tokens=ctx_tokens,
            prefill_requests=v["context_requests"],
            decode_requests=gen_requests,
            decode_tokens=v.get("generation_tokens"),
            kv=_kv(v),
            iteration=int(m.group("iteration")),
            dp_rank=dp,
            extra=_extra(v, elapsed_ms, reading.unread),
        )
        coarse = stamp is not None and not stamp.group("frac")
        return placed + self.placer.add(dp, step, coarse=coarse, duration=duration)

    def flush(self) -> list[AggregateStep]:
        """Steps still held in their second (end of input, or the log went quiet)."""
        return self.placer.flush()

    def _seconds(self, stamp: re.Match[str]) -> float:
        when, missing = parse_month_day(stamp.group("md"), stamp.group("time"), stamp.group("frac"))
        if stamp.group("year"):  # a logging config with the year: nothing rolls over
            when, missing = when.replace(year=int(stamp.group("year"))), 0.0
        return self.clock.seconds(when, missing)

    def _rank(self, m: re.Match[str], prefix: str) -> int | None:
        if m.group("engine") is not None:
            return int(m.group("engine"))
        proc = _last(PROC, prefix)
        dp = DP_OF_PROC.search(proc.group("proc")) if proc else None
        return int(dp.group(1)) if dp else None

    def _engine_info(self, line: str) -> None:
        for name, spec in ENGINE_INFO.items():
            if name in self.engine:
                continue
            found = spec.pattern.search(line)
            if found is not None:
                self.engine[name] = spec.convert(*found.groups())


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = list(pattern.finditer(text))
    return found[-1] if found else None


def _kv(v: dict[str, Any]) -> dict[str, Any] | None:
    kv: dict[str, Any] = {"unit": "block"}
    if "device_usage" in v:
        kv["device"], kv["usage"] = v["device_usage"]
    if "kv_blocks" in v:
        blocks = v["kv_blocks"]
        kv.update(usage=blocks["usage"], used=blocks["used"], total=blocks["total"],
                  tokens=blocks["tokens"])  # fmt: skip
    return kv if len(kv) > 1 else None


def _extra(v: dict[str, Any], elapsed_ms: float | None, unread: tuple[str, ...]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if elapsed_ms is not None:
        extra["elapsed_ms"] = elapsed_ms
    for name in ("encoder_inputs", "encoder_output_embeddings"):
        if name in v:
            extra[name] = v[name]
    if unread:
        extra["unread"] = list(unread)
    return extra
