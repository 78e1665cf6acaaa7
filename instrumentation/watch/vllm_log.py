"""vLLM's iteration log (`--enable-logging-iteration-details`) → aggregate steps.

With that flag vLLM logs one line per engine step (tests/fixtures/watch/SOURCES.md):

    (EngineCore_DP0 pid=2010410) INFO 12-22 21:44:40 [core.py:349] Iteration(515): 0 context
    requests, 0 context tokens, 20 generation requests, 20 generation tokens, iteration elapsed
    time: 10.99 ms

Later versions log it from the front end and append `GPU KV cache usage: Y%` and encoder
counts. A context request is one that has produced no output token yet (a prompt, or a chunk of
one); its tokens are the prompt tokens computed this step. The elapsed time is the wait for the
device, so t1 is the line's time and t0 = t1 - elapsed. vLLM's stamps carry no year: they become
seconds since the first one (logclock.py). Other lines (stat loggers, access logs) are skipped.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from instrumentation.watch.aggregate import AggregateStep
from instrumentation.watch.fields import FieldTable, percent, read_segments, split_body
from instrumentation.watch.fields import field as f
from instrumentation.watch.logclock import LogClock, parse_month_day

SOURCE = "vllm-log"

ITERATION = re.compile(r"\bIteration\((?P<iteration>\d+)\):\s*(?P<body>.*)$")
PREFIX = re.compile(
    r"(?:\((?P<proc>[A-Za-z]+?)(?:_DP(?P<dp>\d+))? pid=\d+\)\s+)?"
    r"(?:DEBUG|INFO|WARNING|ERROR) (?P<md>\d{2}-\d{2}) (?P<time>\d{2}:\d{2}:\d{2})(?:\.(?P<ms>\d+))?"
)
FIELDS = FieldTable(
    {
        "context_requests": f(r"(\d+) context requests"),
        "context_tokens": f(r"(\d+) context tokens"),
        "generation_requests": f(r"(\d+) generation requests"),
        "generation_tokens": f(r"(\d+) generation tokens"),
        "elapsed_ms": f(r"iteration elapsed time: ([\d.]+) ?ms", float),
        "kv_cache_usage": f(r"GPU KV cache usage: ([\d.]+)%", percent),
        "encoder_inputs": f(r"encoder inputs: (\d+)"),
        "encoder_output_embeddings": f(r"encoder output embeddings: (\d+)"),
    }
)
REQUIRED = ("context_requests", "context_tokens", "generation_requests")


@dataclass
class VllmLogReader:
    engine: dict[str, Any]
    status: Counter[str]
    now: Callable[[], float]
    dp_rank: int | None = None
    clock: LogClock = field(default_factory=LogClock)

    def feed(self, line: str) -> list[AggregateStep]:
        self.status["lines"] += 1
        line = line.rstrip("\r\n")
        m = ITERATION.search(line)
        if m is None:
            self.status["skipped"] += 1
            return []
        prefix = PREFIX.search(line[: m.start()])
        dp = int(prefix.group("dp")) if prefix and prefix.group("dp") else None
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
        ctx_tokens, gen_requests = v["context_tokens"], v["generation_requests"]
        if ctx_tokens == 0 and gen_requests == 0:  # a data-parallel dummy step: no work
            self.status["idle_iterations"] += 1
            return []
        if prefix is not None:
            when, missing = parse_month_day(
                prefix.group("md"), prefix.group("time"), prefix.group("ms")
            )
            t1, t_source = self.clock.seconds(when, missing), "log"
        else:
            t1, t_source = self.now(), "received"
        elapsed = v.get("elapsed_ms")
        t0 = t1 - elapsed / 1000.0 if elapsed is not None else t1
        extra: dict[str, Any] = {}
        if elapsed is not None:
            extra["elapsed_ms"] = elapsed
        for name in ("encoder_inputs", "encoder_output_embeddings"):
            if name in v:
                extra[name] = v[name]
        if reading.unread:
            extra["unread"] = list(reading.unread)
        phase = "mixed" if ctx_tokens and gen_requests else ("prefill" if ctx_tokens else "decode")
        usage = v.get("kv_cache_usage")
        return [
            AggregateStep(
                source=SOURCE,
                phase=phase,
                t0=t0,
                t1=t1,
                t_source=t_source,
                prompt_tokens=ctx_tokens,
                prefill_requests=v["context_requests"],
                decode_requests=gen_requests,
                decode_tokens=v.get("generation_tokens"),
                kv={"unit": "block", "usage": usage} if usage is not None else None,
                iteration=int(m.group("iteration")),
                dp_rank=dp,
                extra=extra,
            )
        ]
