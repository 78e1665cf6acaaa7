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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from app.live.encode import StepEncoder, compact_columns, ended_times

RING = 32  # batches a browser may fall behind by and still get a delta, not a reset
MAX_REQUESTS = 200  # request records a reset carries (the newest)
MAX_WAIT_TEXTS = 300  # waits a batch describes at most (a reset over many stalls: the newest)


class Delta(Protocol):
    cursor: int
    reset: bool
    history: int  # the same number for every delta of one history (until cleared or replaced)
    steps: list[dict]
    requests: list[dict]
    engine: dict | None
    config: dict | None


class DeltaSource(Protocol):
    def delta(self, cursor: int | None, metrics: bool = True) -> Delta: ...

    def wait_for_step(self, after: int, timeout: float) -> bool: ...


@runtime_checkable
class WaitSource(Protocol):
    """A store that can say what a request waited for (app.state.EventStore)."""

    def describe_waits(
        self, ended: Iterable[tuple[int, int]], current: Iterable[int], first: Iterable[int]
    ) -> tuple[dict[tuple[int, int], str], dict[int, str], dict[int, str]]: ...


@dataclass(frozen=True)
class _Whole:
    cursor: int
    reset: bool
    history: int
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
        return _Whole(0, True, 0, self.steps, self.requests, self.engine, self.config)

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
        self._narrow(opts.window)
        if opts.paused:
            return self._paused(store, have, entry, opts)
        # A view we do not know (a new tab, a remount, another source), or a wider window
        # (it needs steps the browser dropped): start again from the store's steps.
        if entry is None or entry[2] < opts.window:
            return self._batch(store, None, StepEncoder(), have, opts)
        cursor, encoder, _ = entry
        return self._batch(store, cursor, encoder.copy(), have, opts)

    def _narrow(self, window: int) -> None:
        """The browser drops what is past a narrower window as soon as it is told: no batch it
        holds covers more (a wider window later needs a reset, whichever batch it asks from)."""
        for bid, (cursor, encoder, held) in self._ring.items():
            if held > window:
                self._ring[bid] = (cursor, encoder, window)

    def _paused(
        self, store: DeltaSource, have: int | None, entry: tuple | None, opts: ViewOptions
    ) -> dict[str, Any]:
        """A paused view keeps what it drew; one that holds nothing we know (mounted afresh
        while paused: the pause banner moves the charts down the page) or needs more (a wider
        window) gets the frozen view: the steps this feed had sent when the charts froze."""
        if entry is not None and entry[2] >= opts.window and not _replaced(store, entry[0]):
            return {"id": have, "base": have, "paused": True, "window": opts.window,
                    "xmode": opts.xmode}  # fmt: skip
        return self._batch(store, None, StepEncoder(), have, opts, through=self._frozen_at(store))

    def _frozen_at(self, store: DeltaSource) -> tuple[int, int, float] | None:
        """(cursor, last step, its end) of the newest batch sent, while the store's history is
        still the one it came from; None: there is no frozen view (show what the store has)."""
        if not self._ring:
            return None
        cursor, encoder, _ = next(reversed(self._ring.values()))
        if encoder.last_step is None or _replaced(store, cursor):
            return None
        return cursor, encoder.last_step, encoder.last_t1

    def _batch(
        self,
        store: DeltaSource,
        cursor: int | None,
        encoder: StepEncoder,
        have: int | None,
        opts: ViewOptions,
        through: tuple[int, int, float] | None = None,
    ) -> dict[str, Any]:
        """`through`: only the steps up to a frozen view's last one, and the batch continues
        from that view's cursor."""
        delta = store.delta(cursor, metrics=False)  # the charts need no per-request metrics
        reset = cursor is None or delta.reset or len(delta.steps) >= opts.window
        if reset and cursor is not None:
            encoder = StepEncoder()
        all_steps, requests, next_cursor = delta.steps, delta.requests, delta.cursor
        if through is not None:
            next_cursor, last, t_last = through
            all_steps = [s for s in all_steps if int(s["step"]) <= last]
            # a request queued after the freeze is not in the frozen view
            requests = [r for r in requests if (r.get("t_queued") or 0.0) <= t_last]
        steps = all_steps[-opts.window :] if reset else all_steps
        if not reset and not steps and not requests and have is not None:
            # Nothing new: the same id, so the browser keeps what it has and asks again later.
            self._ring[have] = (next_cursor, encoder, opts.window)
            return {"id": have, "base": have, "window": opts.window, "xmode": opts.xmode}
        ended = ended_times(requests)
        body = encoder.encode(steps, ended)  # its `items` stay here: the browser unpacks `packed`
        batch_id = self._next_id
        self._next_id += 1
        self._ring[batch_id] = (next_cursor, encoder, opts.window)
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
            # which history the steps belong to: the browser keeps the user's zoom over a reset
            # of the history it drew (a wider window, a view drawn again) and drops it for
            # another (cleared, a new engine, another source). It decides, not this feed: a
            # rerun may answer from bookkeeping older than what the browser drew.
            out["history"] = f"{id(store):x}.{delta.history}"
        if opts.paused:
            out["paused"] = True  # a page opened while paused draws, but does not pull
        if rows := encoder.request_rows(requests, MAX_REQUESTS):
            out["requests"] = rows
        if body["stalls"]:
            out["stalls"] = body["stalls"]
        if body["retractions"]:
            out["retractions"] = body["retractions"]
        if isinstance(store, WaitSource):  # a recording drawn whole has no fold to ask
            # a stall still going on changes every step: said in a batch that starts a view (a
            # paused one's included), not again in each live update
            out.update(describe_waits(store, encoder, body, ongoing=reset))
        facts = {k: (delta.engine or {}).get(k) for k in ("page_size", "num_pages", "model")}
        if reset or facts != encoder.engine_sent:
            out["engine"] = encoder.engine_sent = facts
        return out


def describe_waits(
    store: WaitSource, encoder: StepEncoder, body: dict[str, Any], ongoing: bool = True
) -> dict:
    """The batch's waits in words, for the requests with a lane: each stall that ended in it
    (`waits`: [uid, its first step, text, or the index of an earlier row with the same text]),
    with `ongoing` each stall still going on (a fifth
    value of its `ongoing` row), and each first token's wait (`firsts`: [uid, text]). A wait
    not known yet (its token not folded when the batch was made) is asked for again with the
    next batch."""
    lanes = encoder.lanes
    old_stalls, old_firsts = encoder.unsaid
    stalls = [st for st in (*old_stalls, *body["stalls"]) if st[0] in lanes][-MAX_WAIT_TEXTS:]
    firsts = [u for u in (*old_firsts, *body["firsts"]) if u in lanes][-MAX_WAIT_TEXTS:]
    going = [row for row in body["ongoing"] if row[0] in lanes] if ongoing else []
    if not (stalls or firsts or going):
        encoder.unsaid = ([], [])
        return {}
    # a stall [uid, first, last, s] ended with the request's token in step last + 1
    ended, current, first = store.describe_waits(
        [(st[0], st[2] + 1) for st in stalls], [row[0] for row in going], firsts
    )
    fresh = {id(st) for st in body["stalls"]}
    encoder.unsaid = (
        [st for st in stalls if (st[0], st[2] + 1) not in ended and id(st) in fresh],
        [u for u in body["firsts"] if u in lanes and u not in first],
    )
    for row in going:
        if row[0] in current:
            row.append(current[row[0]])
    out: dict[str, list] = {}
    said: list[list] = []
    first_said: dict[str, int] = {}  # under prefill-first every decode's stall reads the same
    for st in stalls:
        text = ended.get((st[0], st[2] + 1))
        if text is None:
            continue
        # a text said before in this batch is sent as the index of the row that says it
        k = first_said.get(text)
        if k is None:
            first_said[text] = len(said)
        said.append([st[0], st[1], text if k is None else k])
    if said:
        out["waits"] = said
    if first:
        out["firsts"] = [[u, text] for u, text in first.items()]
    return out


def _replaced(store: DeltaSource, cursor: int) -> bool:
    """Whether the store's history was replaced (cleared, a new engine) since `cursor`."""
    return store.delta(cursor, metrics=False).reset
