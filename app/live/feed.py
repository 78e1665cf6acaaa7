"""One browser tab's live feed: what its charts already hold, and the batch that extends it.

The browser pulls: after drawing a batch it reports the batch's id (`have`), which reruns the
charts' fragment, and `LiveFeed.payload` answers with what the store recorded since that
batch's cursor. History the browser holds is never sent again. A pull from an id this feed does
not know (a new tab, a remount, a batch lost on the way) gets a reset: the last `window` steps.
Remembering the last few batches' cursors (and encoder states) lets a browser that missed a
payload ask again from where it really is.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from app.live.encode import StepEncoder, compact_columns, ended_times

RING = 32  # batches a browser may fall behind by and still get a delta, not a reset
MAX_REQUESTS = 200  # request records a reset carries (the newest)


class Delta(Protocol):
    cursor: int
    reset: bool
    steps: list[dict]
    requests: list[dict]
    engine: dict | None
    config: dict | None


class DeltaSource(Protocol):
    def delta(self, cursor: int | None, metrics: bool = True) -> Delta: ...

    def wait_for_step(self, after: int, timeout: float) -> bool: ...


@dataclass(frozen=True)
class _Whole:
    cursor: int
    reset: bool
    steps: list[dict]
    requests: list[dict]
    engine: dict | None
    config: dict | None


@dataclass(frozen=True)
class Recorded:
    """A record drawn whole (a compared recording): every step and request at once, read as a
    store's delta, so it is encoded exactly as the live charts' batches are."""

    steps: list[dict]
    requests: list[dict]
    engine: dict | None = None
    config: dict | None = None

    def delta(self, cursor: int | None, metrics: bool = True) -> Delta:
        return _Whole(0, True, self.steps, self.requests, self.engine, self.config)

    def wait_for_step(self, after: int, timeout: float) -> bool:
        return False  # nothing more will come

    def batch(self, xmode: str) -> dict[str, Any]:
        """The one batch that draws it all (a reset)."""
        opts = ViewOptions(window=max(len(self.steps), 1), xmode=xmode, paused=True)
        return LiveFeed().payload(self, None, opts)


@dataclass(frozen=True)
class ViewOptions:
    window: int  # steps the browser keeps
    xmode: str  # "step" | "time"
    paused: bool = False


class LiveFeed:
    def __init__(self) -> None:
        self._ring: OrderedDict[int, tuple[int, StepEncoder, int]] = OrderedDict()
        self._next_id = 1
        self.updates = 0  # payloads with new data (for the status line and tests)

    def hold(self, store: DeltaSource, have: int | None, timeout: float) -> None:
        """Wait (at most `timeout` s) until the store has a step the browser's batch `have`
        does not: a pull then answers as soon as the engine's next step lands. No wait when
        `have` is unknown (the answer is a reset) or there is news already."""
        entry = self._ring.get(have) if have is not None else None
        if entry is not None:
            store.wait_for_step(entry[0], timeout)

    def payload(self, store: DeltaSource, have: int | None, opts: ViewOptions) -> dict[str, Any]:
        """The data for the component: a batch after `have`, a reset, or nothing new."""
        entry = self._ring.get(have) if have is not None else None
        if opts.paused and entry is not None:
            return {"id": have, "base": have, "paused": True, "window": opts.window}
        # A wider window needs steps the browser dropped: start again.
        if entry is None or entry[2] < opts.window:
            return self._batch(store, None, StepEncoder(), have, opts)
        cursor, encoder, _ = entry
        return self._batch(store, cursor, encoder.copy(), have, opts)

    def _batch(
        self,
        store: DeltaSource,
        cursor: int | None,
        encoder: StepEncoder,
        have: int | None,
        opts: ViewOptions,
    ) -> dict[str, Any]:
        delta = store.delta(cursor, metrics=False)  # the charts need no per-request metrics
        reset = cursor is None or delta.reset or len(delta.steps) >= opts.window
        if reset and cursor is not None:
            encoder = StepEncoder()
        steps = delta.steps[-opts.window :] if reset else delta.steps
        if not reset and not steps and not delta.requests and have is not None:
            # Nothing new: the same id, so the browser keeps what it has and asks again later.
            self._ring[have] = (delta.cursor, encoder, opts.window)
            return {"id": have, "base": have, "window": opts.window, "xmode": opts.xmode}
        ended = ended_times(delta.requests)
        body = encoder.encode(steps, ended)  # its `items` stay here: the browser unpacks `packed`
        batch_id = self._next_id
        self._next_id += 1
        self._ring[batch_id] = (delta.cursor, encoder, opts.window)
        while len(self._ring) > RING:
            self._ring.popitem(last=False)
        self.updates += 1
        out: dict[str, Any] = {
            "id": batch_id,
            "base": None if reset else have,
            "window": opts.window,
            "xmode": opts.xmode,
            "config": delta.config or {},  # read by the component, not sent to the browser
            "steps": compact_columns(body["steps"]),
            "packed": body["packed"],
            "ongoing": body["ongoing"],
        }
        # what the browser keeps between batches is sent when it changed, not every time
        if reset:
            out["reset"] = True
        if opts.paused:
            out["paused"] = True  # a page opened while paused draws, but does not pull
        if rows := encoder.request_rows(delta.requests, MAX_REQUESTS):
            out["requests"] = rows
        if body["stalls"]:
            out["stalls"] = body["stalls"]
        if body["retractions"]:
            out["retractions"] = body["retractions"]
        facts = {k: (delta.engine or {}).get(k) for k in ("page_size", "num_pages", "model")}
        if reset or facts != encoder.engine_sent:
            out["engine"] = encoder.engine_sent = facts
        return out
