"""vLLM's KV-cache events (`--kv-events-config`; SGLang publishes the same schema) → the KV view.

The engine publishes a `KVEventBatch` per scheduler step that changed its prefix cache, in
msgpack over a ZMQ PUB socket framed as `(topic, seq as 8 bytes big-endian, payload)`. Upstream
names, read here as vLLM's msgspec structs define them:

    KVEventBatch: ts, events, data_parallel_rank
    BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
        lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
    BlockRemoved: block_hashes, medium, group_idx
    AllBlocksCleared: (no fields)

The events are tagged unions (`tag=True`): as a map the tag is the `type` key, in the older
`array_like=True` layout it is the first element, and `omit_defaults` drops trailing defaults.
The batch itself was an array (ts, events, rank) in older releases and is a map in newer ones.

The watch keeps the set of blocks the cache holds (stored and not yet removed, per medium and
KV-cache group) and broadcasts, per batch, a `kv_events` message: what changed and what is held.
A stored block is held whether a running request still uses it or only the cache keeps it; the
events do not tell the two apart, and the message says only what they tell.
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
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
DEFAULT_MEDIUM = "GPU"  # vLLM's MEDIUM_GPU; events from before `medium` existed were all GPU


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # BlockStored, BlockRemoved, AllBlocksCleared
    fields: dict[str, Any]


def decode_batch(payload: bytes) -> tuple[dict[str, Any], list[Event]] | None:
    """(batch fields, events) of one payload, or None when it is not a KVEventBatch."""
    import msgpack

    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(obj, list):
        obj = dict(zip(BATCH_FIELDS, obj, strict=False))
    if not isinstance(obj, dict) or not isinstance(obj.get("events"), list):
        return None
    events = []
    for raw in obj["events"]:
        event = _event(raw)
        if event is None:
            return None
        events.append(event)
    return obj, events


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind = raw.get("type")
        values = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        values = dict(zip(EVENT_FIELDS.get(kind, ()), raw[1:], strict=False))
    else:
        return None
    if kind not in EVENT_FIELDS:
        return None
    return Event(kind, values)


def _key(h: Any) -> Hashable:
    return tuple(h) if isinstance(h, list) else h


@dataclass
class KvBlocks:
    """The blocks the engine's prefix cache holds, as its events tell."""

    held: dict[tuple[str, int | None, Hashable], int] = field(default_factory=dict)  # -> tokens
    block_size: int | None = None

    def apply(self, event: Event, status: Counter[str]) -> tuple[int, int, bool]:
        """Apply one event; returns (blocks stored, blocks removed, cleared)."""
        v = event.fields
        medium = v.get("medium") or DEFAULT_MEDIUM
        group = v.get("group_idx")
        if event.kind == "AllBlocksCleared":
            self.held.clear()
            return 0, 0, True
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
            for h in hashes:
                self.held[(medium, group, _key(h))] = per_block
            return len(hashes), 0, False
        removed = 0
        for h in hashes:
            if self.held.pop((medium, group, _key(h)), None) is None:
                status["removed_unknown_blocks"] += 1  # stored before the watch started
            else:
                removed += 1
        return 0, removed, False

    def by_medium(self) -> dict[str, int]:
        return dict(Counter(medium for medium, _, _ in self.held))


@dataclass
class KvEventsReader:
    status: Counter[str]
    now: Callable[[], float]
    total_blocks: int | None = None  # the engine's GPU block count, when given on the command line
    blocks: KvBlocks = field(default_factory=KvBlocks)
    _last_seq: int | None = None

    def feed(self, frames: Frames) -> dict[str, Any] | None:
        """One published batch → the `kv_events` message fields (without type and seq)."""
        self.status["kv_batches"] += 1
        seq, payload = envelope(frames)
        try:
            decoded = decode_batch(payload)
        except Exception:  # any malformed payload: counted, never fatal
            decoded = None
        if decoded is None:
            self.status["unreadable"] += 1
            return None
        if seq is not None and self._last_seq is not None and seq > self._last_seq + 1:
            self.status["lost"] += seq - self._last_seq - 1  # the held count may now be off
        if seq is not None:
            self._last_seq = seq
        batch, events = decoded
        stored = removed = 0
        cleared = False
        for event in events:
            s, r, c = self.blocks.apply(event, self.status)
            stored, removed, cleared = stored + s, removed + r, cleared or c
            self.status["kv_" + event.kind] += 1
        held = self.blocks.held
        msg: dict[str, Any] = {
            "source": SOURCE,
            "t": self.now(),
            "t_source": "received",
            "ts": batch.get("ts"),  # the engine's wall clock (time.time()) when it published
            "batch_seq": seq,
            "stored_blocks": stored,
            "removed_blocks": removed,
            "cleared": cleared,
            "blocks": len(held),
            "tokens": sum(held.values()),
            "block_size": self.blocks.block_size,
            "by_medium": self.blocks.by_medium(),
        }
        if batch.get("data_parallel_rank") is not None:
            msg["dp_rank"] = batch["data_parallel_rank"]
        if self.total_blocks:
            msg["total_blocks"] = self.total_blocks
        return msg
