"""SGLang's scheduler log → aggregate steps.

SGLang's scheduler prints one `Prefill batch` line per prefill (or mixed) batch and one
`Decode batch` line every `--decode-log-interval` decode steps (default 40). The wording changed
across versions; every variant below was read in SGLang's scheduler source or in logs pasted into
public threads (tests/fixtures/watch/SOURCES.md):

- 2024-04: `new fill batch. #seq: 1. #cached_token: 757. #new_token: 1. #remaining_req: 4. ...`
  and an unprefixed decode line `#running-req: 5, #token: 1938, token usage: 0.24, #queue-req: 0`;
- 2024: `Prefill batch. #new-seq: ..., cache hit rate: ...%, ...` and, with mixed chunking,
  `Prefill batch(mixed #running-req: N). ...`; `Decode batch. ...`;
- 2025 on: `Prefill batch, ...` with `#pending-token`, any device's graph flag (`cuda`, `npu`,
  `musa` graph), throughput fields, hybrid pools (`full token usage`, `swa token usage`, `mamba
  usage`), HiSparse's device and host pools (`#gpu-token`, `#cpu-token`), prefill-decode
  disaggregation queues, speculative decoding's `accept len`, a trailing `, `, and with
  SGLANG_LOG_FORWARD_ITERS a forward counter: `Prefill batch [123], ...`.

The prefix `[date time(.ms) DP0 TP0 EP0]` may carry a date (or only a time, or milliseconds with
SGLANG_LOG_MS) and rank tags; anything before it (a Ray actor's `(SGLangEngine pid=..)`, a
pasted file name) is ignored. Each DP rank is its own engine; within one, lines of another TP,
PP or attention-CP rank repeat the batch and are counted, not read. Lines that are not batch
lines (access logs, progress bars, warnings) are skipped and counted; a batch line whose
required field cannot be read is counted as unreadable, never fatal; a segment no pattern reads
is kept in `unread`. Times stamped to the second are placed by placement.py.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from instrumentation.watch.aggregate import AggregateStep, TimeSource
from instrumentation.watch.fields import Field, FieldTable, flag, percent, read_segments, split_body
from instrumentation.watch.fields import field as f
from instrumentation.watch.logclock import LogClock, parse_stamp
from instrumentation.watch.placement import StepPlacer

SOURCE = "sglang-log"
DEFAULT_DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval default
MIN_INFERRED_CHUNK = 64  # two equal prefill sizes below this are more likely coincidence

BATCH = re.compile(
    r"(?P<kind>Prefill|Decode) batch"
    r"(?: \[(?P<iteration>\d+)\])?"
    r"(?:\(mixed #running-req: (?P<mixed>\d+)\))?"
    r"[.,]\s*(?P<body>.*)$"
)
FILL_2024 = re.compile(r"new fill batch\. (?P<body>.*)$")
DECODE_2024 = re.compile(r"(?:^|\] )(?P<body>#running-req: \d+, #token: \d+, .*)$")
STAMP = re.compile(
    r"\[(?:(?P<date>\d{4}-\d{2}-\d{2}) )?(?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d+))?"
    r"(?P<ranks>(?: [A-Z][A-Z_]*\d+)*)\]"
)
RANK = re.compile(r"([A-Z][A-Z_]*?)(\d+)$")


# One table per format: field name -> pattern of its whole segment.
def _graph(backend: str, used: str) -> tuple[str, bool]:
    return backend, flag(used)


FIELDS = FieldTable(
    {
        "new_seq": f(r"#new-seq: (\d+)"),
        "new_token": f(r"#new-token: (\d+)"),
        "cached_token": f(r"#cached-token: (\d+)"),
        "cache_hit_rate": f(r"cache hit rate: ([\d.]+)%", percent),
        "token_usage": f(r"token usage: ([\d.]+)", float),
        "full_token_usage": f(r"full token usage: ([\d.]+)", float),
        "swa_token_usage": f(r"swa token usage: ([\d.]+)", float),
        "mamba_usage": f(r"mamba usage: ([\d.]+)", float),
        "token": f(r"#token: (\d+)"),
        "full_token": f(r"#full token: (\d+)"),
        "swa_token": f(r"#swa token: (\d+)"),
        "mamba_num": f(r"mamba num: (\d+)"),
        # HiSparse (2026): device buffer and host pool instead of #token / token usage
        "gpu_token": f(r"#gpu[- ]token: (\d+)"),
        "gpu_token_usage": f(r"gpu token usage: ([\d.]+)", float),
        "cpu_token": f(r"#cpu[- ]token: (\d+)"),
        "cpu_token_usage": f(r"cpu token usage: ([\d.]+)", float),
        "running_req": f(r"#running-req: (\d+)"),
        "queue_req": f(r"#queue-req: (\d+)"),
        "pending_token": f(r"#pending-token: (\d+)"),
        # prefill-decode disaggregation: the prefill side's queues (2025: #unbootstrapped-req and
        # #transferring-req; 2026: #bootstrap-req and #inflight-req), the decode side's
        "unbootstrapped_req": f(r"#unbootstrapped-req: (\d+)"),
        "transferring_req": f(r"#transferring-req: (\d+)"),
        "bootstrap_req": f(r"#bootstrap-req: (\d+)"),
        "inflight_req": f(r"#inflight-req: (\d+)"),
        "prealloc_req": f(r"#prealloc-req: (\d+)"),
        "transfer_req": f(r"#transfer-req: (\d+)"),
        "retracted_req": f(r"#retracted-req: (\d+)"),
        "preallocated_usage": f(r"pre-allocated usage: ([\d.]+)", float),
        "waiting_image_req": f(r"waiting-image-req: (\d+)"),
        "accept_len": f(r"accept len: ([\d.]+)", float),
        "accept_rate": f(r"accept rate: ([\d.]+)", float),
        "graph": f(r"(\w+) graph: (True|False)", _graph),  # cuda, npu, musa, cpu, ...
        "gen_throughput": f(r"gen throughput \(token/s\): ([\d.]+)", float),
        "input_throughput": f(r"input throughput \(token/s\): ([\d.]+)", float),
        "est_tflops": f(r"est\. (?:prefill|decode) TFLOPS/s \(per GPU\): ([\d.]+)", float),
        "est_read_bw": f(r"est\. read BW \(GB/s per GPU\): ([\d.]+)", float),
        "est_write_bw": f(r"est\. write BW \(GB/s per GPU\): ([\d.]+)", float),
        "fwd_occupancy": f(r"fwd occupancy: ([\d.]+)%", percent),
    }
)
FIELDS_2024_FILL = FieldTable(
    {
        "new_seq": f(r"#seq: (\d+)"),
        "cached_token": f(r"#cached_token: (\d+)"),
        "new_token": f(r"#new_token: (\d+)"),
        "queue_req": f(r"#remaining_req: (\d+)"),
        "running_req": f(r"#running_req: (\d+)"),
        "cache_hit_rate": f(r"tree_cache_hit_rate: ([\d.]+)%", percent),
    }
)
# Figures a step carries under their own names (docs/watch.md), beyond the common aggregates.
EXTRA_NAMES = {
    "cache_hit_rate": "lifetime_cache_hit_rate",  # hits / prompt tokens since the server started
    "pending_token": "pending_tokens",
    "input_throughput": "input_throughput",
    "gen_throughput": "gen_throughput",
    "accept_len": "accept_len",
    "accept_rate": "accept_rate",
    "unbootstrapped_req": "unbootstrapped_requests",
    "transferring_req": "transferring_requests",
    "bootstrap_req": "bootstrap_requests",
    "inflight_req": "inflight_requests",
    "prealloc_req": "prealloc_requests",
    "transfer_req": "transfer_requests",
    "retracted_req": "retracted_requests",
    "preallocated_usage": "preallocated_usage",
    "waiting_image_req": "waiting_image_requests",
    "est_tflops": "est_tflops_per_gpu",
    "est_read_bw": "est_read_gb_s_per_gpu",
    "est_write_bw": "est_write_gb_s_per_gpu",
    "fwd_occupancy": "fwd_occupancy",
}
# Start-up lines (server_args=ServerArgs(...), "max_total_num_tokens=..., ...") fill hello.engine.
ENGINE_INFO: dict[str, Field] = {
    "model_path": f(r"\bmodel_path='([^']*)'", str),
    "served_model_name": f(r"\bserved_model_name='([^']*)'", str),
    "max_total_num_tokens": f(r"\bmax_total_num_tokens=(\d+)"),
    "chunked_prefill_size": f(r"\bchunked_prefill_size=(-?\d+)"),
    "max_prefill_tokens": f(r"\bmax_prefill_tokens=(\d+)"),
    "max_running_requests": f(r"\bmax_running_requests=(\d+)"),
    "context_len": f(r"\bcontext_len=(\d+)"),
    "page_size": f(r"\bpage_size=(\d+)"),
    "decode_log_interval": f(r"\bdecode_log_interval=(\d+)"),
    "tp_size": f(r"\btp_size=(\d+)"),
    "dp_size": f(r"\bdp_size=(\d+)"),
}


@dataclass(slots=True)
class _Stream:
    """Per data-parallel rank: each DP rank has its own scheduler and prints its own lines."""

    # The other rank tags (TP, PP, ATTN_CP, EP, ...) whose lines this stream reads: lines of the
    # same DP rank with other tags repeat the same batch.
    ranks: tuple[tuple[str, int], ...] | None = None
    last_prefill_tokens: int | None = None


@dataclass
class SglangLogReader:
    """Feed lines with `feed()`; it returns the steps they make. `engine` (hello.engine) gains
    what start-up lines say; `status` counts lines by fate. `overrides` come from the command
    line and win over what the log says."""

    engine: dict[str, Any]
    status: Counter[str]
    now: Callable[[], float]
    overrides: dict[str, Any] = field(default_factory=dict)
    dp_rank: int | None = None  # only this DP rank's lines, when set
    clock: LogClock = field(default_factory=LogClock)
    streams: dict[int | None, _Stream] = field(default_factory=dict)
    placer: StepPlacer = field(default_factory=StepPlacer)

    def __post_init__(self) -> None:
        self.engine.update(self.overrides)
        if "decode_log_interval" not in self.engine:
            self.engine["decode_log_interval"] = DEFAULT_DECODE_LOG_INTERVAL
            self.engine["decode_log_interval_source"] = "sglang default (not in the log)"

    def feed(self, line: str) -> list[AggregateStep]:
        self.status["lines"] += 1
        line = line.rstrip("\r\n")
        kind, m = _classify(line)
        if m is None:
            self._engine_info(line)
            self.status["skipped"] += 1
            stamp = _last_stamp(line[:80])
            if stamp is None:  # any stamped line: the log has reached this time
                return []
            return self.placer.advance(self._when(stamp)[0])
        stamp = _last_stamp(line[: m.start("body")])
        ranks = _ranks(stamp.group("ranks")) if stamp else {}
        if not self._keep(ranks):
            return []
        table, separators = (
            (FIELDS_2024_FILL, r"\.\s+|\.\s*$") if kind == "fill" else (FIELDS, None)
        )
        reading = read_segments(split_body(m.group("body"), separators), table)
        if reading.unread:
            self.status["unread_fields"] += len(reading.unread)
        t, t_source = self._when(stamp)
        common: dict[str, Any] = {
            "t0": t,
            "t1": t,
            "t_source": t_source,
            "dp_rank": ranks.get("DP"),
        }
        if kind in ("prefill", "decode") and m.group("iteration"):
            common["iteration"] = int(m.group("iteration"))
        v = reading.values
        extra = {EXTRA_NAMES[k]: v[k] for k in EXTRA_NAMES if k in v}
        if "graph" in v:
            extra["graph_backend"], extra["graph"] = v["graph"]
        if reading.unread:
            extra["unread"] = list(reading.unread)
        if kind in ("prefill", "fill"):
            mixed = m.group("mixed") if kind == "prefill" else None
            step = self._prefill(v, mixed, ranks, common, extra)
        else:
            step = self._decode(v, common, extra)
        if step is None:
            self.status["unreadable"] += 1
            return []
        placed = self.placer.advance(t) if t_source == "log" else []
        coarse = stamp is not None and not stamp.group("frac")
        return placed + self.placer.add(ranks.get("DP"), step, coarse=coarse)

    def flush(self) -> list[AggregateStep]:
        """Steps still held in their second (end of input, or the log went quiet)."""
        return self.placer.flush()

    def _when(self, stamp: re.Match[str] | None) -> tuple[float, TimeSource]:
        if stamp is None:
            return self.now(), "received"
        when, missing = parse_stamp(stamp.group("date"), stamp.group("time"), stamp.group("frac"))
        return self.clock.seconds(when, missing), "log"

    def _keep(self, ranks: dict[str, int]) -> bool:
        dp = ranks.get("DP")
        if self.dp_rank is not None and dp != self.dp_rank:
            self.status["other_dp_rank_lines"] += 1
            return False
        stream = self.streams.setdefault(dp, _Stream())
        others = tuple(sorted((k, v) for k, v in ranks.items() if k != "DP"))
        if not others:  # no rank tags: nothing to repeat
            return True
        if stream.ranks is None:
            stream.ranks = others
        if others != stream.ranks:  # another TP/PP/CP rank printing the same batch
            self.status["other_rank_lines"] += 1
            return False
        return True

    def _prefill(
        self,
        v: dict[str, Any],
        mixed: str | None,
        ranks: dict[str, int],
        common: dict[str, Any],
        extra: dict[str, Any],
    ) -> AggregateStep | None:
        if "new_token" not in v:
            return None
        tokens = v["new_token"]
        budget = self._budget(ranks.get("DP"), tokens)
        if budget is not None:
            extra["budget_full"] = tokens >= budget  # a request was probably cut into a chunk
        running = v.get("running_req", int(mixed) if mixed is not None else None)
        return AggregateStep(
            source=SOURCE,
            phase="mixed" if mixed is not None else "prefill",
            prompt_tokens=tokens,
            cached_tokens=v.get("cached_token"),
            prefill_requests=v.get("new_seq"),
            decode_requests=int(mixed) if mixed is not None else None,
            waiting=v.get("queue_req"),
            running=running,
            kv=self._kv(v),
            budget=budget,
            extra=extra,
            **common,
        )

    def _decode(
        self, v: dict[str, Any], common: dict[str, Any], extra: dict[str, Any]
    ) -> AggregateStep | None:
        if "running_req" not in v:
            return None
        return AggregateStep(
            source=SOURCE,
            phase="decode",
            decode_requests=v["running_req"],
            waiting=v.get("queue_req"),
            running=v["running_req"],
            kv=self._kv(v),
            sample_of_steps=int(self.engine["decode_log_interval"]),
            extra=extra,
            **common,
        )

    def _budget(self, dp: int | None, tokens: int) -> int | None:
        """The chunk size: from the command line or the log's server args, else inferred from
        two consecutive prefill batches of the same size (a long prompt cut into chunks)."""
        size = self.engine.get("chunked_prefill_size")
        if isinstance(size, int) and size > 0:
            return size
        stream = self.streams[dp]
        # Chunk sizes are powers of two in SGLang's defaults and in the configurations seen; two
        # equal batches of another size (e.g. 896) are more likely equal prompts.
        power_of_two = tokens & (tokens - 1) == 0
        if stream.last_prefill_tokens == tokens and tokens >= MIN_INFERRED_CHUNK and power_of_two:
            self.engine.setdefault("inferred_chunk_size", tokens)
        stream.last_prefill_tokens = tokens
        return self.engine.get("inferred_chunk_size")

    def _kv(self, v: dict[str, Any]) -> dict[str, Any] | None:
        """Token-pool figures: `used` as SGLang counts it (held by requests, not evictable cache),
        `usage` its ratio to the pool, `total` when the log or the command line says it. HiSparse
        prints its device buffer (`#gpu token`) and host pool (`#cpu token`) instead: `used` and
        `usage` are the device's, `pools.cpu` the host's."""
        kv: dict[str, Any] = {"unit": "token"}
        usage = _first(v, "token_usage", "full_token_usage", "gpu_token_usage")
        used = _first(v, "token", "full_token", "gpu_token")
        total = self.engine.get("max_total_num_tokens")
        if usage is not None:
            kv["usage"] = usage
        if used is not None:
            kv["used"] = used
        elif usage is not None and total:
            kv["used"] = round(usage * total)
            kv["approx"] = True  # from a ratio printed with two decimals
        if total:
            kv["total"] = total
        pools = {}
        for pool, count, ratio in (
            ("swa", "swa_token", "swa_token_usage"),
            ("mamba", "mamba_num", "mamba_usage"),
            ("cpu", "cpu_token", "cpu_token_usage"),
        ):
            if count in v or ratio in v:
                pools[pool] = _pool(v.get(count), v.get(ratio))
        if pools:
            kv["pools"] = pools
        return kv if len(kv) > 1 else None

    def _engine_info(self, line: str) -> None:
        if "=" not in line:
            return
        for name, spec in ENGINE_INFO.items():
            if name in self.overrides:
                continue
            m = spec.pattern.search(line)
            if m is not None:
                self.engine[name] = spec.convert(m.group(1))
                if name == "decode_log_interval":
                    self.engine.pop("decode_log_interval_source", None)
        name = self.engine.get("served_model_name") or self.engine.get("model_path")
        if name and "model" not in self.overrides:
            self.engine["model"] = name


def _classify(line: str) -> tuple[str, re.Match[str] | None]:
    """("prefill" | "decode" | "fill" | "decode2024", match) of a batch line; (.., None) else."""
    m = BATCH.search(line)
    if m is not None:
        return m.group("kind").lower(), m
    m = FILL_2024.search(line)
    if m is not None:
        return "fill", m
    m = DECODE_2024.search(line)
    return "decode2024", m


def _first(v: dict[str, Any], *names: str) -> Any:
    return next((v[n] for n in names if n in v), None)


def _pool(used: int | None, usage: float | None) -> dict[str, Any]:
    return {k: val for k, val in (("used", used), ("usage", usage)) if val is not None}


def _last_stamp(prefix: str) -> re.Match[str] | None:
    stamps = list(STAMP.finditer(prefix))
    return stamps[-1] if stamps else None


def _ranks(text: str) -> dict[str, int]:
    ranks = {}
    for tag in text.split():
        m = RANK.match(tag)
        if m:
            ranks[m.group(1)] = int(m.group(2))
    return ranks
