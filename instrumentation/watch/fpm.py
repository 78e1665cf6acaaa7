"""Forward-pass metrics (SGLang `--forward-pass-metrics-port`, later `--enable-forward-pass-metrics`;
vLLM `--forward-pass-metrics-port`) → aggregate steps.

Both engines publish one msgpack message per forward pass on a ZMQ PUB socket, framed as
`(topic, seq as 8 bytes big-endian, payload)`. The payload is a msgspec struct
`ForwardPassMetrics`; its field names are read here exactly as upstream defines them:

    ForwardPassMetrics: version, worker_id, dp_rank, counter_id, timing_scope (vLLM only),
        wall_time, scheduled_requests, queued_requests
    scheduled_requests: num_prefill_requests, sum_prefill_tokens, var_prefill_length,
        sum_prefill_kv_tokens, num_decode_requests, sum_decode_kv_tokens, var_decode_kv_tokens
    queued_requests: num_prefill_requests, sum_prefill_tokens, var_prefill_length,
        num_decode_requests, sum_decode_kv_tokens, var_decode_kv_tokens

msgspec encodes structs as maps by default; the positional (array) layout of each version is
read too (the field order differs by version, told apart by the types). A message with nothing
scheduled is an idle heartbeat, not a step. The message carries a duration but no timestamp, so
a step's t1 is when the watch received it and t0 = t1 - wall_time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from instrumentation.watch.aggregate import AggregateStep
from instrumentation.watch.zmq_sub import Frames, envelope

SUPPORTED_VERSION = 1
FPM_FIELDS_V0 = ("worker_id", "dp_rank", "wall_time", "scheduled_requests", "queued_requests")
FPM_FIELDS_V1 = ("version", "worker_id", "dp_rank", "counter_id", "wall_time") + FPM_FIELDS_V0[3:]
FPM_FIELDS_VLLM = FPM_FIELDS_V1[:4] + ("timing_scope",) + FPM_FIELDS_V1[4:]
SCHEDULED_FIELDS = (
    "num_prefill_requests",
    "sum_prefill_tokens",
    "var_prefill_length",
    "sum_prefill_kv_tokens",
    "num_decode_requests",
    "sum_decode_kv_tokens",
    "var_decode_kv_tokens",
)
QUEUED_FIELDS = (
    "num_prefill_requests",
    "sum_prefill_tokens",
    "var_prefill_length",
    "num_decode_requests",
    "sum_decode_kv_tokens",
    "var_decode_kv_tokens",
)


def decode_payload(payload: bytes) -> dict[str, Any] | None:
    """The message as a dict of upstream field names, or None when it is not one."""
    import msgpack

    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(obj, list):
        obj = _positional(obj)
    if not isinstance(obj, dict):
        return None
    for name, names in (
        ("scheduled_requests", SCHEDULED_FIELDS),
        ("queued_requests", QUEUED_FIELDS),
    ):
        part = obj.get(name, {})
        if isinstance(part, list):
            part = dict(zip(names, part, strict=False))
        if not isinstance(part, dict):
            return None
        obj[name] = part
    return obj


def _positional(values: list[Any]) -> dict[str, Any] | None:
    types = [type(v) for v in values]
    if len(values) == 5 and types[0] is str:
        return dict(zip(FPM_FIELDS_V0, values, strict=True))
    if len(values) == 7 and types[1] is str:
        return dict(zip(FPM_FIELDS_V1, values, strict=True))
    if len(values) == 8 and types[1] is str and types[4] is str:
        return dict(zip(FPM_FIELDS_VLLM, values, strict=True))
    return None


@dataclass
class FpmReader:
    source: str  # "sglang-fpm" or "vllm-fpm"
    engine: dict[str, Any]
    status: Counter[str]
    now: Callable[[], float]
    _last_seq: int | None = None  # the envelope's: one counter per publishing socket

    def feed(self, frames: Frames) -> list[AggregateStep]:
        self.status["messages"] += 1
        seq, payload = envelope(frames)
        self._count_lost(seq)
        try:
            m = decode_payload(payload)
        except Exception:  # any malformed payload: counted, never fatal
            m = None
        if m is None:
            self.status["unreadable"] += 1
            return []
        version = m.get("version", SUPPORTED_VERSION)
        if version != SUPPORTED_VERSION:
            self.status["unsupported_version"] += 1
            return []
        worker, dp = str(m.get("worker_id", "")), _int(m.get("dp_rank"), 0)
        self.engine.setdefault("worker_id", worker)
        s, q = m["scheduled_requests"], m["queued_requests"]
        n_prefill = _int(s.get("num_prefill_requests"), 0)
        n_decode = _int(s.get("num_decode_requests"), 0)
        wall = float(m.get("wall_time") or 0.0)
        if n_prefill == 0 and n_decode == 0:
            self.status["heartbeats" if wall == 0.0 else "empty_passes"] += 1
            return []
        t1 = self.now()
        phase = "mixed" if n_prefill and n_decode else ("prefill" if n_prefill else "decode")
        waiting = _int(q.get("num_prefill_requests"), 0) + _int(q.get("num_decode_requests"), 0)
        upstream = {k: m[k] for k in ("worker_id", "counter_id", "timing_scope") if k in m}
        upstream.update(wall_time=wall, scheduled_requests=s, queued_requests=q)
        return [
            AggregateStep(
                source=self.source,
                phase=phase,
                t0=t1 - wall,
                t1=t1,
                t_source="received",
                prompt_tokens=_int(s.get("sum_prefill_tokens"), None),
                prefill_requests=n_prefill,
                decode_requests=n_decode,
                waiting=waiting,
                # no `iteration`: counter_id counts published messages, heartbeats included,
                # not steps (it stays in `fpm.counter_id`)
                dp_rank=dp,
                extra={"fpm": upstream},
            )
        ]

    def _count_lost(self, seq: int | None) -> None:
        if seq is None:
            return
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.status["lost"] += seq - self._last_seq - 1
        self._last_seq = seq


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
