"""The KV page map's data path: ask the engine for its pool page by page, keep the newest answer.

The `kv_map` command (docs/protocol.md) is sent only while the page map is open; its reply goes
to this client alone. `PageMapStore` is the connection's store with one addition: it keeps the
newest `kv_map` reply (the store proper records events, and a page map is a reading, not an
event), so the page can wait for the answer to the command it just sent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from app.state import EventStore, Message

STATES = ("free", "cached", "used", "shared")


class PageMapStore(EventStore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._map_lock = threading.Condition()
        self._map: Message | None = None

    def apply(self, msg: Message) -> bool:
        if msg.get("type") == "kv_map":
            with self._map_lock:
                self._map = msg
                self._map_lock.notify_all()
            return False
        return super().apply(msg)

    def page_map(self) -> Message | None:
        with self._map_lock:
            return self._map

    def wait_page_map(self, command_id: str, timeout: float) -> Message | None:
        """The reply to `command_id`, or the newest map there is when it does not come in time."""
        with self._map_lock:
            self._map_lock.wait_for(
                lambda: self._map is not None and self._map.get("id") == command_id, timeout
            )
            return self._map


def page_counts(runs: Iterable[list[int]]) -> dict[str, Any]:
    """Totals of a run-length encoded map: pages per state, and pages per owning request."""
    counts = dict.fromkeys(STATES, 0)
    owners: dict[int, int] = {}
    for length, state, uid, _sharers in runs:
        counts[STATES[state]] += length
        if STATES[state] in ("used", "shared"):
            owners[uid] = owners.get(uid, 0) + length
    return {**counts, "owners": owners}
