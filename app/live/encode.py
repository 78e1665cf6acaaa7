"""The live charts' view model: recorded step messages → compact columns, new steps only.

`StepEncoder.encode(steps, ended)` turns the steps after the browser's cursor into one batch of
columns the browser appends (app/live/static/live.js draws them). Everything a chart shows is
decided here, from the messages alone: each item's place in the step's stack, per-step totals
for the zoomed-out level of detail, and which decoding requests a step left out (stalls).
The encoder carries only what spans batches (each decoding request's last token), so its work
is proportional to the new steps, never to what is in view. It is pure: tested without a
browser (tests/test_app_live.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]

PHASES = ("prefill", "decode", "mixed")
KINDS = ("chunk", "prefill", "decode")  # the item kind codes sent to the browser
SAMPLING = frozenset({"prefill", "decode"})
REQUEST_FIELDS = (
    "uid",
    "state",
    "prompt_len",
    "cached_len",
    "output_len",
    "max_tokens",
    "t_queued",
    "t_first_token",
    "t_finished",
)
ENDED = frozenset({"finished", "aborted", "rejected"})
EPS = 1e-9


def _r(t: float) -> float:
    # Engine times to 0.1 ms: enough for any chart, and a third of the bytes of a full float.
    return round(float(t), 4)


@dataclass
class _Open:
    """A decoding request's last token, and the stall it is in (if any)."""

    step: int  # step number of its last token
    t1: float
    skipped_from: int | None = None  # first step number it was left out of since


@dataclass
class StepEncoder:
    """Encodes step messages batch by batch; `copy()` it to replay from an earlier batch."""

    decoding: dict[int, _Open] = field(default_factory=dict)
    ended_at: dict[int, float] = field(default_factory=dict)  # decoding requests that ended
    last_step: int | None = None
    last_t1: float = 0.0

    def copy(self) -> StepEncoder:
        # by hand: deepcopy costs more than encoding a batch
        return StepEncoder(
            {u: _Open(o.step, o.t1, o.skipped_from) for u, o in self.decoding.items()},
            dict(self.ended_at),
            self.last_step,
            self.last_t1,
        )

    def encode(self, steps: Sequence[Message], ended: Mapping[int, float]) -> dict[str, Any]:
        """Columns for `steps` (oldest first, all after the previous batch's).

        `ended` maps requests known to have ended to their end time: a request that finished
        is not stalled in the steps after its end, and its trailing gap is no stall.
        """
        cols: dict[str, list] = {
            k: []
            for k in (
                "step", "t0", "t1", "phase", "budget", "used", "cached", "free", "total",
                "reserved", "waiting", "running", "prompt", "decode", "wasted", "stalled",
                "sampled",
            )
        }  # fmt: skip
        items: dict[str, list] = {k: [] for k in ("i", "uid", "kind", "a", "b", "base", "w")}
        stalls: list[list] = []
        self.ended_at.update(ended)
        for i, s in enumerate(steps):
            self._step(i, s, cols, items, stalls)
        for uid in [u for u, t in self.ended_at.items() if t <= self.last_t1 + EPS]:
            self.decoding.pop(uid, None)
        # what is left ended after the last step (its stall is not over) or never decoded
        self.ended_at = {u: t for u, t in self.ended_at.items() if u in self.decoding}
        ongoing = [
            [uid, o.skipped_from, self.last_step, _r(self.last_t1 - o.t1)]
            for uid, o in self.decoding.items()
            if o.skipped_from is not None
        ]
        return {"steps": cols, "items": items, "stalls": stalls, "ongoing": ongoing}

    def _step(
        self,
        i: int,
        s: Message,
        cols: dict[str, list],
        items: dict[str, list],
        stalls: list[list],
    ) -> None:
        number, t0, t1 = int(s["step"]), float(s["t0"]), float(s["t1"])
        kv, queue = s.get("kv") or {}, s.get("queue") or {}
        # Decodes at the bottom, prompt pieces above them, work wasted on ended requests on top.
        ordered = sorted(
            s["items"], key=lambda it: (bool(it.get("wasted")), it["kind"] != "decode")
        )
        base = prompt = decode = wasted = 0
        sampled: set[int] = set()
        for it in ordered:
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
            if it["kind"] in SAMPLING and not w:
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
            stalled += 1
            if o.skipped_from is None:
                o.skipped_from = number
        for uid in gone:
            del self.decoding[uid]
        for uid in sampled:
            o = self.decoding.get(uid)
            if o is not None and o.skipped_from is not None:
                # the stall ends with this token: steps [skipped_from, number - 1] went without
                stalls.append([uid, o.skipped_from, number - 1, _r(t1 - o.t1)])
            self.decoding[uid] = _Open(number, t1)
        self.last_step, self.last_t1 = number, t1
        for key, value in (
            ("step", number), ("t0", _r(t0)), ("t1", _r(t1)),
            ("phase", PHASES.index(s["phase"]) if s["phase"] in PHASES else 2),
            ("budget", int(s.get("budget") or 0)),
            ("used", int(kv.get("used", 0))), ("cached", int(kv.get("cached", 0))),
            ("free", int(kv.get("free", 0))), ("total", int(kv.get("total", 0))),
            ("reserved", int(kv.get("reserved", 0))),
            ("waiting", int(queue.get("waiting", 0))), ("running", int(queue.get("running", 0))),
            ("prompt", prompt), ("decode", decode), ("wasted", wasted), ("stalled", stalled),
            ("sampled", len(sampled)),
        ):  # fmt: skip
            cols[key].append(value)


def ended_times(requests: Iterable[Message]) -> dict[int, float]:
    """Requests that ended, with the time they did."""
    out: dict[int, float] = {}
    for r in requests:
        if r.get("state") in ENDED:
            t = r.get("t_finished")
            out[int(r["uid"])] = float(t) if t is not None else float("-inf")
    return out


def request_rows(requests: Iterable[Message], limit: int) -> list[list]:
    """The newest `limit` request records, as rows of REQUEST_FIELDS (no text: it is large)."""
    rows = [[_round(r.get(k)) for k in REQUEST_FIELDS] for r in requests]
    return rows[-limit:]


def _round(v: Any) -> Any:
    return _r(v) if isinstance(v, float) else v
