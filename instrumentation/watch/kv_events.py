"""vLLM's KV-cache events (`--kv-events-config`; SGLang publishes the same schema) → the KV view.

The engine publishes a `KVEventBatch` per scheduler step that changed its prefix cache, in
msgpack over a ZMQ PUB socket framed as `(topic, seq as 8 bytes big-endian, payload)`. Upstream
names, read here as vLLM's msgspec structs define them (0.32):

    KVEventBatch: ts, events, data_parallel_rank
    BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
        lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
        locality, ownership, session_id
    BlockRemoved: block_hashes, medium, group_idx, locality, ownership
    AllBlocksCleared: (no fields)

The events are tagged unions (`tag=True`): as a map the tag is the `type` key, in the older
`array_like=True` layout it is the first element, and `omit_defaults` drops trailing defaults.
The batch itself is an array (ts, events, rank) or, in some releases, a map. An event of a type
not listed is skipped and counted on its own; the rest of its batch is read.

The watch keeps the set of blocks the cache holds (stored and not yet removed, per medium and
KV-cache group) and broadcasts, per batch, a `kv_events` message: what changed and what is held.
A `BlockStored` of a block already held is vLLM announcing a prefix-cache hit (it does so for
requests sent with `kv_cache_report_mode: "full"`): counted as `reused_blocks`, not as stored.
A stored block is held whether a running request still uses it or only the cache keeps it; the
events do not tell the two apart, and the message says only what they tell.

Sequence numbers: a jump means batches were missed (a slow subscriber, a restart of the watch).
With vLLM's replay socket (`replay_endpoint`) the missed batches are asked for and applied in
order before the one that revealed the gap; what the engine no longer holds stays lost, and the
message that follows says so (`gap`), since the held set may then be off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from instrumentation.watch.zmq_sub import Frames, envelope

SOURCE = "vllm-kv-events"
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
DEFAULT_MEDIUM = "GPU"  # vLLM's MEDIUM_GPU; events from before `medium` existed were all GPU

Replay = Callable[[int], "list[Frames] | None"]  # start seq -> the batches from it on, or None
TimeOf = Callable[[float], "float | None"]  # the engine's wall clock (ts) -> the steps' clock


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # BlockStored, BlockRemoved, AllBlocksCleared
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Batch:
    fields: dict[str, Any]  # ts, data_parallel_rank
    events: list[Event]
    unknown: list[str]  # the tags of events of types this reader does not know


def decode_batch(payload: bytes) -> Batch | None:
    """One payload, or None when it is not a KVEventBatch."""
    import msgpack

    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(obj, list):
        obj = dict(zip(BATCH_FIELDS, obj, strict=False))
    if not isinstance(obj, dict) or not isinstance(obj.get("events"), list):
        return None
    events, unknown = [], []
    for raw in obj["events"]:
        event = _event(raw)
        if isinstance(event, Event):
            events.append(event)
        else:
            unknown.append(event)
    return Batch(obj, events, unknown)


def _event(raw: Any) -> Event | str:
    """The event, or the tag of an event this reader cannot read (`?` when it has none)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        values = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        values = dict(zip(EVENT_FIELDS.get(kind, ()), raw[1:], strict=False))
    else:
        return "?"
    if kind not in EVENT_FIELDS:
        return str(kind) if kind is not None else "?"
    return Event(kind, values)


def _key(h: Any) -> Hashable:
    return tuple(h) if isinstance(h, list) else h


@dataclass
class KvBlocks:
    """The blocks the engine's prefix cache holds, as its events tell."""

    held: dict[tuple[str, int | None, Hashable], int] = field(default_factory=dict)  # -> tokens
    block_size: int | None = None

    def apply(self, event: Event, status: Counter[str]) -> tuple[int, int, int, bool]:
        """Apply one event; returns (blocks stored, reused, removed, cleared)."""
        v = event.fields
        medium = v.get("medium") or DEFAULT_MEDIUM
        group = v.get("group_idx")
        if event.kind == "AllBlocksCleared":
            self.held.clear()
            return 0, 0, 0, True
        hashes = v.get("block_hashes") or []
        if event.kind == "BlockStored":
            size = v.get("block_size")
            if isinstance(size, int) and size > 0:
                self.block_size = size
            # Stored blocks are full blocks: block_size tokens each (token_ids covers them all).
            tokens = v.get("token_ids")
            per_block = self.block_size or (
                len(tokens) // len(hashes) if isinstance(tokens, list) and hashes else 0
            )
            stored = reused = 0
            for h in hashes:
                key = (medium, group, _key(h))
                if key in self.held:
                    reused += 1  # already held: a prefix-cache hit announced again
                else:
                    self.held[key] = per_block
                    stored += 1
            return stored, reused, 0, False
        removed = 0
        for h in hashes:
            if self.held.pop((medium, group, _key(h)), None) is None:
                status["removed_unknown_blocks"] += 1  # stored before the watch started
            else:
                removed += 1
        return 0, 0, removed, False

    def by_medium(self) -> dict[str, int]:
        return dict(Counter(medium for medium, _, _ in self.held))


@dataclass
class KvEventsReader:
    status: Counter[str]
    now: Callable[[], float]
    total_blocks: int | None = None  # the engine's GPU block count, when given on the command line
    replay: Replay | None = None  # vLLM's replay socket, when configured
    time_of: TimeOf | None = None  # places a batch on the steps' clock by its `ts`
    blocks: KvBlocks = field(default_factory=KvBlocks)
    _last_seq: int | None = None

    def feed(self, frames: Frames) -> list[dict[str, Any]]:
        """One published message → `kv_events` message fields (without type and seq): none for a
        duplicate or unreadable one, several when a gap before it was recovered by replay."""
        seq, _ = envelope(frames)
        out: list[dict[str, Any]] = []
        gap: dict[str, int] | None = None
        if seq is not None:
            if self._last_seq is not None and seq <= self._last_seq:
                self.status["kv_duplicates"] += 1  # already applied (from a replay)
                return []
            expected = 0 if self._last_seq is None else self._last_seq + 1
            if seq > expected:
                recovered = self._recover(expected, seq, out)
                self.status["lost"] += seq - expected - recovered
                self.status["kv_recovered"] += recovered
                # what is still missing right before this batch (a loss before a recovered
                # batch was told on that batch)
                since = expected if self._last_seq is None else self._last_seq + 1
                if seq > since:
                    gap = {"lost": seq - since, "recovered": recovered}
        msg = self._apply(frames, gap)
        return out + ([msg] if msg is not None else [])

    def _recover(self, start: int, end: int, out: list[dict[str, Any]]) -> int:
        """Ask the replay socket for batches start..end-1 and apply them in order."""
        if self.replay is None:
            return 0
        batches = self.replay(start)
        if batches is None:
            self.status["kv_replay_failed"] += 1
            return 0
        recovered = 0
        for frames in batches:
            seq, _ = envelope(frames)
            if seq is None or seq < start or seq >= end:
                continue
            if self._last_seq is not None and seq <= self._last_seq:
                continue
            # batches the engine no longer held before this one: told on the first recovered
            lost_before = seq - (start if self._last_seq is None else self._last_seq + 1)
            gap = {"lost": lost_before, "recovered": 0} if lost_before > 0 else None
            msg = self._apply(frames, gap)
            if msg is not None:
                out.append(msg)
                recovered += 1
        return recovered

    def _apply(self, frames: Frames, gap: dict[str, int] | None) -> dict[str, Any] | None:
        self.status["kv_batches"] += 1
        seq, payload = envelope(frames)
        try:
            batch = decode_batch(payload)
        except Exception:  # any malformed payload: counted, never fatal
            batch = None
        if seq is not None:
            self._last_seq = seq
        if batch is None:
            self.status["unreadable"] += 1
            return None
        for tag in batch.unknown:
            self.status["kv_unknown_events"] += 1
            self.status[f"kv_unknown:{tag}"] += 1
        stored = reused = removed = 0
        cleared = False
        for event in batch.events:
            s, u, r, c = self.blocks.apply(event, self.status)
            stored, reused, removed = stored + s, reused + u, removed + r
            cleared = cleared or c
            self.status["kv_" + event.kind] += 1
        ts = batch.fields.get("ts")
        t = self.time_of(float(ts)) if self.time_of is not None and _number(ts) else None
        held = self.blocks.held
        msg: dict[str, Any] = {
            "source": SOURCE,
            "t": t if t is not None else self.now(),
            "t_source": "engine" if t is not None else "received",
            "ts": ts,  # the engine's wall clock (time.time()) when the scheduler made the batch
            "batch_seq": seq,
            "stored_blocks": stored,
            "reused_blocks": reused,
            "removed_blocks": removed,
            "cleared": cleared,
            "blocks": len(held),
            "tokens": sum(held.values()),
            "block_size": self.blocks.block_size,
            "by_medium": self.blocks.by_medium(),
        }
        if batch.unknown:
            msg["unknown_events"] = len(batch.unknown)
        if gap is not None:
            msg["gap"] = gap
        if batch.fields.get("data_parallel_rank") is not None:
            msg["dp_rank"] = batch.fields["data_parallel_rank"]
        if self.total_blocks:
            msg["total_blocks"] = self.total_blocks
        return msg


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def hit_rate(messages: list[dict[str, Any]]) -> float | None:
    """The prefix-cache hit rate the events report over `messages`: reused blocks over reused
    plus newly stored ones; None when no batch reported a reuse (vLLM announces hits only for
    requests with `kv_cache_report_mode: "full"`, so zero reuse is not a measured 0%)."""
    reused = sum(int(m.get("reused_blocks") or 0) for m in messages)
    stored = sum(int(m.get("stored_blocks") or 0) for m in messages)
    return _rate(reused, stored)


def running_hit_rate(messages: list[dict[str, Any]]) -> list[float | None]:
    """`hit_rate` of the messages up to and including each one, in one pass."""
    out: list[float | None] = []
    reused = stored = 0
    for m in messages:
        reused += int(m.get("reused_blocks") or 0)
        stored += int(m.get("stored_blocks") or 0)
        out.append(_rate(reused, stored))
    return out


def _rate(reused: int, stored: int) -> float | None:
    return None if reused == 0 else reused / (reused + stored)
