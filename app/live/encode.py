"""The live charts' view model: recorded step messages → compact columns, new steps only.

`StepEncoder.encode(steps, ended)` turns the steps after the browser's cursor into one batch of
columns the browser appends (app/live/static/data.js keeps them, the charts draw them). Everything
a chart shows is decided here, from the messages alone: each item's place in the step's stack,
per-step totals for the zoomed-out level of detail, and which decoding requests a step left out
(stalls, by the protocol's rule: `instrumentation.metrics.stalled_between`, the one definition
every view uses).
The encoder carries only what spans batches (each decoding request's last token), so its work
is proportional to the new steps, never to what is in view. It is pure: tested without a
browser (tests/app/test_app_live.py).

On the wire a step's items are packed (`packed`, see `unpack`): at batch 64 a step is 64
one-token decodes of the same requests as the step before, so each step says only how its
decode set differs from the previous one (who left, who joined and at which position, whose
work was wasted) and lists its prompt pieces. Decodes keep their place in the stack from step
to step (oldest decoder at the bottom), so a request's band runs straight across the chart.

A batch also names the waits a lane shows (`waits` in app/live/feed.py): what each stall that
ended in it, each stall still going on and each first token waited for, in words
(instrumentation.blame), for the requests with a lane only and each wait once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from instrumentation.fold import samples
from instrumentation.metrics import stalled_between
from instrumentation.protocol import WAIT_REASONS

Message = dict[str, Any]

PHASES = ("prefill", "decode", "mixed")
KINDS = ("chunk", "prefill", "decode", "recompute")  # the item kind codes sent to the browser
REASONS = (None, *WAIT_REASONS)  # a step's waiting reason, as a code (0: nothing waited)
# what the charts read of a request (its lanes: waiting, first token, end); a row is sent again
# only when one of these changed, not for every token
REQUEST_FIELDS = ("uid", "state", "t_queued", "t_first_token", "t_finished")
ENDED = frozenset({"finished", "aborted", "rejected"})
MAX_LANES = 40  # the timeline draws a lane for each of the newest requests, this many
EPS = 1e-9


def _r(t: float) -> float:
    # Engine times to 0.1 ms: enough for any chart, and a third of the bytes of a full float.
    return round(float(t), 4)


@dataclass
class _Open:
    """A decoding request's last token."""

    step: int  # step number of its last token
    t1: float


@dataclass
class StepEncoder:
    """Encodes step messages batch by batch; `copy()` it to replay from an earlier batch."""

    decoding: dict[int, _Open] = field(default_factory=dict)
    ended_at: dict[int, float] = field(default_factory=dict)  # decoding requests that ended
    last_step: int | None = None
    last_t1: float = 0.0
    # the decode stack of the last step that had decodes: uid -> its next position, in order
    ref: dict[int, int] = field(default_factory=dict)
    rows: dict[int, tuple] = field(default_factory=dict)  # request rows as last sent
    engine_sent: dict[str, Any] | None = None  # the engine facts as last sent
    # the requests with a lane (the newest MAX_LANES by their first step, oldest first): only
    # their waits are described
    lanes: dict[int, None] = field(default_factory=dict)
    # waits asked for in the last batch and not yet known (a step's tokens may not have been
    # folded when its batch was made): (stalls as [uid, first, last, s], first-token uids)
    unsaid: tuple[list[list], list[int]] = ([], [])

    def copy(self) -> StepEncoder:
        # by hand: deepcopy costs more than encoding a batch
        return StepEncoder(
            {u: _Open(o.step, o.t1) for u, o in self.decoding.items()},
            dict(self.ended_at),
            self.last_step,
            self.last_t1,
            dict(self.ref),
            dict(self.rows),
            self.engine_sent,
            dict(self.lanes),
            self.unsaid,
        )

    def request_rows(self, requests: Iterable[Message], limit: int) -> list[list]:
        """The rows of REQUEST_FIELDS that changed since this encoder last sent them (at most
        the newest `limit`); an ended request's row is sent once, then forgotten."""
        out = []
        for r in requests:
            row = tuple(_round(r.get(k)) for k in REQUEST_FIELDS)
            uid = row[0]
            if self.rows.get(uid) == row:
                continue
            out.append(list(row))
            if r.get("state") in ENDED:
                self.rows.pop(uid, None)
            else:
                self.rows[uid] = row
        return out[-limit:]

    def encode(self, steps: Sequence[Message], ended: Mapping[int, float]) -> dict[str, Any]:
        """Columns for `steps` (oldest first, all after the previous batch's).

        `ended` maps requests known to have ended to their end time: a request that finished
        is not stalled in the steps after its end, and its trailing gap is no stall.
        """
        cols: dict[str, list] = {k: [] for k in STEP_COLUMNS}
        items: dict[str, list] = {k: [] for k in ITEM_FIELDS}
        packed: list[dict[str, Any]] = []
        stalls: list[list] = []
        firsts: list[int] = []
        self.ended_at.update(ended)
        for i, s in enumerate(steps):
            self._step(i, s, cols, items, packed, stalls)
            firsts.extend(int(it["uid"]) for it in s["items"]
                          if it["kind"] == "prefill" and not it.get("wasted"))  # fmt: skip
        for uid in [u for u, t in self.ended_at.items() if t <= self.last_t1 + EPS]:
            self.decoding.pop(uid, None)
        # what is left ended after the last step (its stall is not over) or never decoded
        self.ended_at = {u: t for u, t in self.ended_at.items() if u in self.decoding}
        # still waiting for a token: a stall if one came right after the last step
        after = None if self.last_step is None else self.last_step + 1
        ongoing = [
            [uid, o.step + 1, self.last_step, _r(self.last_t1 - o.t1)]
            for uid, o in self.decoding.items()
            if after is not None and stalled_between(o.step, after)
        ]
        return {
            "steps": cols,
            "items": items,
            "packed": packed,
            "stalls": stalls,
            "ongoing": ongoing,
            "firsts": firsts,  # requests whose first token these steps sampled
            # [step, uid] of each retraction: a marker on the timeline, a gap in its lane
            "retractions": [
                [int(s["step"]), int(u)] for s in steps for u in s.get("retracted") or ()
            ],
        }

    def _pack(self, step_items: Sequence[Message]) -> tuple[list[Message], dict[str, Any]]:
        """This step's items in stack order, and their packed form (see `unpack`)."""
        dec = [it for it in step_items if it["kind"] == "decode" and _len(it) == 1]
        by_uid = {int(it["uid"]): it for it in dec}
        if len(by_uid) < len(dec):  # a request twice in one step: no stack to keep
            dec, by_uid = [], {}
        in_stack = {id(it) for it in dec}
        other = [it for it in step_items if id(it) not in in_stack]
        pack: dict[str, Any] = {}
        if dec:
            kept = [u for u, nxt in self.ref.items() if u in by_uid and _start(by_uid[u]) == nxt]
            kept_set = set(kept)
            added = [it for it in dec if int(it["uid"]) not in kept_set]
            dropped = [u for u in self.ref if u not in kept_set]
            self.ref = {u: self.ref[u] + 1 for u in kept}
            for it in added:
                self.ref[int(it["uid"])] = _start(it) + 1
            if dropped:
                pack["dd"] = dropped
            if added:
                pack["da"] = [v for it in added for v in (int(it["uid"]), _start(it))]
            stack = [by_uid[u] for u in self.ref]
            waste = [int(it["uid"]) for it in stack if it.get("wasted")]
            if waste:
                pack["dw"] = waste
        else:
            stack = []
            if self.ref:
                pack["n"] = 1  # no decodes this step; the stack is kept for the next
        if other:
            pack["p"] = [
                v
                for it in other
                for v in (
                    int(it["uid"]),
                    KINDS.index(it["kind"]),
                    _start(it),
                    int(it["end"]),
                    1 if it.get("wasted") else 0,
                )
            ]
        live = [it for it in stack if not it.get("wasted")]
        done = [it for it in stack if it.get("wasted")]
        order = live + [it for it in other if not it.get("wasted")]
        order += done + [it for it in other if it.get("wasted")]
        return order, pack

    def _step(
        self,
        i: int,
        s: Message,
        cols: dict[str, list],
        items: dict[str, list],
        packed: list[dict[str, Any]],
        stalls: list[list],
    ) -> None:
        number, t0, t1 = int(s["step"]), float(s["t0"]), float(s["t1"])
        kv, queue = s.get("kv") or {}, s.get("queue") or {}
        order, pack = self._pack(s["items"])
        packed.append(pack)
        # Decodes at the bottom (in the stack's order), prompt pieces above, wasted work on top.
        base = prompt = decode = wasted = 0
        sampled: set[int] = set()
        lanes = self.lanes
        for it in order:
            uid = int(it["uid"])
            # uids grow and admission is FIFO: one older than every lane has had its lane
            if uid not in lanes and (len(lanes) < MAX_LANES or uid > next(iter(lanes))):
                lanes[uid] = None
                if len(lanes) > MAX_LANES:
                    del lanes[next(iter(lanes))]
            n = int(it["end"]) - int(it["start"])
            w = bool(it.get("wasted"))
            items["i"].append(i)
            items["uid"].append(int(it["uid"]))
            items["kind"].append(KINDS.index(it["kind"]))
            items["a"].append(int(it["start"]))
            items["b"].append(int(it["end"]))
            items["base"].append(base)
            items["w"].append(1 if w else 0)
            base += n
            if w:
                wasted += n
            elif it["kind"] == "decode":
                decode += n
            else:
                prompt += n
            if samples(it):
                sampled.add(int(it["uid"]))
        stalled = 0
        gone = []
        for uid, o in self.decoding.items():
            if uid in sampled:
                continue
            t_end = self.ended_at.get(uid)
            if t_end is not None and t_end <= t1 + EPS:
                # It ended by the time this step did (under overlap, the step may have been
                # launched just before the end was read): its trailing gap is no stall.
                gone.append(uid)
                continue
            # this step ran without it: its next token ends a stall (it is in one now)
            stalled += stalled_between(o.step, number + 1)
        for uid in gone:
            del self.decoding[uid]
        for uid in sampled:
            o = self.decoding.get(uid)
            if o is not None and stalled_between(o.step, number):
                # the stall ends with this token: steps [o.step + 1, number - 1] went without
                stalls.append([uid, o.step + 1, number - 1, _r(t1 - o.t1)])
            self.decoding[uid] = _Open(number, t1)
        self.last_step, self.last_t1 = number, t1
        for key, value in (
            ("step", number), ("t0", _r(t0)), ("t1", _r(t1)),
            ("phase", PHASES.index(s["phase"]) if s["phase"] in PHASES else 2),
            ("budget", int(s.get("budget") or 0)),
            ("used", int(kv.get("used") or 0)), ("cached", int(kv.get("cached") or 0)),
            ("free", int(kv.get("free") or 0)), ("total", int(kv.get("total") or 0)),
            ("reserved", int(kv.get("reserved") or 0)),
            ("waiting", int(queue.get("waiting") or 0)), ("running", int(queue.get("running") or 0)),
            ("prompt", prompt), ("decode", decode), ("wasted", wasted), ("stalled", stalled),
            ("sampled", len(sampled)), ("retracted", len(s.get("retracted") or ())),
            ("reason", REASONS.index(queue.get("waiting_reason"))
             if queue.get("waiting_reason") in REASONS else 0),
        ):  # fmt: skip
            cols[key].append(value)


STEP_COLUMNS = (
    "step", "t0", "t1", "phase", "budget", "used", "cached", "free", "total", "reserved",
    "waiting", "running", "prompt", "decode", "wasted", "stalled", "sampled", "retracted",
    "reason",
)  # fmt: skip


def _start(it: Message) -> int:
    return int(it["start"])


def _len(it: Message) -> int:
    return int(it["end"]) - int(it["start"])


ITEM_FIELDS = ("i", "uid", "kind", "a", "b", "base", "w")


def unpack(packed: Sequence[Mapping[str, Any]], ref: Mapping[int, int]) -> dict[str, list]:
    """The item columns of `encode` from its packed steps, given the decode stack before them
    (`ref`: uid -> next position, in stack order). The browser runs the same steps
    (unpackItems in static/data.js); this one is the format's definition, for the tests."""
    stack = dict(ref)
    items: dict[str, list] = {k: [] for k in ITEM_FIELDS}
    for i, pk in enumerate(packed):
        rows: list[tuple[int, int, int, int, int]] = []  # uid, kind, a, b, wasted
        if not pk.get("n") and (stack or pk.get("da")):
            for u in pk.get("dd", []):
                del stack[u]
            da = pk.get("da", [])
            for k in range(0, len(da), 2):
                stack[da[k]] = da[k + 1]
            waste = set(pk.get("dw", []))
            rows = [(u, 2, a, a + 1, 1 if u in waste else 0) for u, a in stack.items()]
            stack = {u: a + 1 for u, a in stack.items()}
        p = pk.get("p", [])
        others = [tuple(p[k : k + 5]) for k in range(0, len(p), 5)]
        ordered = [r for r in rows if not r[4]] + [r for r in others if not r[4]]
        ordered += [r for r in rows if r[4]] + [r for r in others if r[4]]
        base = 0
        for uid, kind, a, b, w in ordered:
            for key, v in zip(ITEM_FIELDS, (i, uid, kind, a, b, base, w), strict=True):
                items[key].append(v)
            base += b - a
    return items


def compact_columns(cols: Mapping[str, list]) -> dict[str, Any]:
    """A batch's step columns with each column that holds one value throughout sent as that
    value (the pool's size, the budget, the queue in a steady state): the browser expands it."""
    out: dict[str, Any] = {}
    for name, col in cols.items():
        out[name] = col[0] if len(col) > 1 and col.count(col[0]) == len(col) else col
    return out


def expand_columns(cols: Mapping[str, Any]) -> dict[str, list]:
    """The inverse of `compact_columns` (the browser's expandColumns in static/data.js)."""
    n = max((len(c) for c in cols.values() if isinstance(c, list)), default=0)
    return {k: c if isinstance(c, list) else [c] * n for k, c in cols.items()}


def ended_times(requests: Iterable[Message]) -> dict[int, float]:
    """Requests that ended, with the time they did."""
    out: dict[int, float] = {}
    for r in requests:
        if r.get("state") in ENDED:
            t = r.get("t_finished")
            out[int(r["uid"])] = float(t) if t is not None else float("-inf")
    return out


def _round(v: Any) -> Any:
    return _r(v) if isinstance(v, float) else v
