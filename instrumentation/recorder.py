"""The server's recorder: a bounded history of the broadcast stream, for a late client's `hello`.

It is the shared fold (instrumentation.fold) with the server's bounds: the last `max_steps`
steps, every request in flight, and ended requests up to a count and a byte budget, so a server
that has served millions of requests holds no more than a few tens of megabytes of history.
"""

from __future__ import annotations

from typing import Any

from instrumentation.fold import ENDED_STATES, Fold, RequestRecord

__all__ = ["ENDED_STATES", "Recorder", "RequestRecord"]


class Recorder(Fold):
    """Feed it every broadcast message in order with `record()`; read `history()` any time."""

    def __init__(
        self,
        *,
        max_steps: int = 2000,
        max_ended: int = 2000,
        max_ended_bytes: int = 32 * 2**20,
        config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            max_steps=max_steps,
            max_ended=max_ended,
            max_ended_bytes=max_ended_bytes,
            config=config,
        )

    def record(self, msg: dict[str, Any]) -> None:
        self.apply(msg)
