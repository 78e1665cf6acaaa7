"""The recorded-events store: one engine connection's messages, folded by the shared fold
(instrumentation.fold) into steps and request records, plus the replies and a raw log.

One store per engine connection, written by the connection thread and read by every browser tab,
so every method takes the lock and readers get copies (`Snapshot`, `Delta`), never live
structures. The store also watches delivery (protocol v1.1): a jump in `seq` means messages
were lost, and the store asks its link to resync (`needs_resync`), after which the new `hello`
fills in what was missed; another `hello.engine.instance` is another engine (a restart).

The fold names every request's delay wait by wait (`Fold(delays=True)`, instrumentation.delay):
the page describes a lane's waits, the headline's worst stall and the Delays tab from it. A
token's wait costs a few hundred bytes, so only the newest ended requests keep theirs
(`MAX_KEPT_WAITS`); every ended request keeps its `Delay`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from instrumentation.blame import (
    StallCause,
    request_delay,
    request_wait,
    stall_cause,
    worst_stall_cause,
)
from instrumentation.delay import Delay
from instrumentation.fold import ENDED_STATES, Fold, Summary

Message = dict[str, Any]

MAX_STEPS = 20_000
MAX_LOG = 200_000
MAX_ENDED_REQUESTS = 2_000
MAX_REPLIES = 500
MAX_KV_EVENTS = 5_000  # a watch's `kv_events` batches (the prefix cache as its engine reports it)
# ended requests' token-by-token waits kept (the newest requests'), about 400 bytes each
MAX_KEPT_WAITS = 60_000
# the fold's bound on ended requests' bytes: their token times and text, and the waits kept
MAX_ENDED_BYTES = 32 * 2**20 + 400 * MAX_KEPT_WAITS
# replies kept for `wait_reply`, by the id of the command they answer
REPLY_TYPES = frozenset(("accepted", "error", "config", "kv_map", "stats"))


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of the store: what one redraw of the page is built from."""

    steps: list[Message]
    requests: list[Message]
    engine: dict[str, Any] | None
    config: dict[str, Any] | None
    version: int
    messages_seen: int = 0
    lost: int = 0  # broadcasts lost in gaps (resynced since) on this engine instance
    resyncs: int = 0
    restarts: int = 0
    # a watched engine's KV-event batches (`kv_events`, an extension), oldest first
    kv_events: list[Message] = field(default_factory=list)

    @property
    def page_size(self) -> int:
        return int((self.engine or {}).get("page_size") or 1)


@dataclass(frozen=True)
class Delta:
    """What changed since a cursor: the live charts append `steps` and update `requests`."""

    cursor: int  # pass it back to the next `delta()`
    reset: bool  # the history was replaced (resync or new engine): redraw from `steps`
    history: int  # the version the current history began at: one number per history
    steps: list[Message]  # step messages after the cursor, oldest first
    requests: list[Message]  # request records changed since the cursor
    engine: dict[str, Any] | None
    config: dict[str, Any] | None
    lost: int
    resyncs: int
    instance: str | None
    restarted: bool  # an engine restart happened since the cursor


class EventStore:
    """Everything one engine connection has said, bounded in memory."""

    def __init__(self, max_steps: int = MAX_STEPS, max_log: int = MAX_LOG) -> None:
        self._lock = threading.Lock()
        self._replied = threading.Condition(self._lock)
        self._stepped = threading.Condition(self._lock)  # a step folded, or history replaced
        self._fold = _new_fold(max_steps)
        self._kept_waits: deque[tuple[int, int]] = deque()  # (uid, waits) of ended requests
        self._kept_wait_count = 0
        # the version at which each kept step was folded, for `delta`
        self._step_versions: deque[int] = deque(maxlen=max_steps)
        self._changed: OrderedDict[int, int] = OrderedDict()  # uid -> version, oldest first
        self._log: deque[Message] = deque(maxlen=max_log)
        self._kv_events: deque[Message] = deque(maxlen=MAX_KV_EVENTS)
        self._replies: OrderedDict[str, Message] = OrderedDict()
        self._last_t = float("-inf")
        self._cleared_through_step = -1
        self._cleared_uids: set[int] = set()
        self._version = 0
        self._reset_version = 0  # the version of the last history replacement
        self._restart_version = -1
        self._seen = 0
        self.resyncs = 0
        self.restarts = 0
        self._gap_pending = False

    # ---- writing (the connection thread) -------------------------------------------------

    def apply(self, msg: Message) -> bool:
        """Fold one server message; True when a gap was found and the link should resync."""
        kind = msg.get("type")
        with self._lock:
            self._seen += 1
            self._version += 1
            if kind == "hello":
                self._apply_hello(msg)
                self._stepped.notify_all()
            else:
                self._log.append(msg)
                before = self._fold.num_steps
                if self._fold.apply(msg) is not None:
                    self._gap_pending = True  # keep folding; the resync's hello fills the gap
                if self._fold.num_steps != before:
                    self._step_versions.append(self._version)
                    self._stepped.notify_all()
                    self._last_t = max(self._last_t, float(msg.get("t1", self._last_t)))
                if kind in ("request", "token") and "uid" in msg:
                    self._touch(int(msg["uid"]))
                    if kind == "request" and msg.get("event") in ENDED_STATES:
                        self._keep_waits(int(msg["uid"]))
                elif kind == "kv_events":
                    self._kv_events.append(msg)
            if kind in REPLY_TYPES and msg.get("id") is not None:
                self._replies[str(msg["id"])] = msg
                while len(self._replies) > MAX_REPLIES:
                    self._replies.popitem(last=False)
                self._replied.notify_all()
            return self._gap_pending

    @property
    def needs_resync(self) -> bool:
        with self._lock:
            return self._gap_pending

    def _keep_waits(self, uid: int) -> None:
        """An ended request's waits are kept; the oldest ended requests' beyond
        MAX_KEPT_WAITS are dropped (their `Delay` stays)."""
        rec = self._fold.get(uid)
        if rec is None or not rec.delay_gaps:
            return
        self._kept_waits.append((uid, len(rec.delay_gaps)))
        self._kept_wait_count += len(rec.delay_gaps)
        while self._kept_wait_count > MAX_KEPT_WAITS and len(self._kept_waits) > 1:
            old_uid, n = self._kept_waits.popleft()
            self._kept_wait_count -= n
            old = self._fold.get(old_uid)
            if old is not None and old.ended and old.delay_gaps:
                before = old.approx_bytes()
                old.delay_gaps = None
                self._fold._ended_bytes -= before - old.approx_bytes()  # as the fold counts

    def _touch(self, uid: int) -> None:
        self._changed[uid] = self._version
        self._changed.move_to_end(uid)
        while len(self._changed) > 4 * MAX_ENDED_REQUESTS:
            self._changed.popitem(last=False)

    def _apply_hello(self, msg: Message) -> None:
        fold = self._fold
        engine = msg.get("engine") or {}
        now = float(msg.get("now") or 0.0)
        instance = engine.get("instance")
        if fold.instance is not None or instance is not None:
            restarted = fold.engine is not None and instance != fold.instance
        else:  # a v1.0 engine names no instance: a clock behind what we saw is another engine
            restarted = now < self._last_t
        if restarted:
            self._reset()
            self.restarts += 1
            self._restart_version = self._version
            fold = self._fold
        elif self._gap_pending:
            self.resyncs += 1
        self._gap_pending = False
        self._log.append(msg)
        history = msg.get("history") or {}
        steps = [
            s
            for s in history.get("steps") or []
            if isinstance(s, dict) and int(s.get("step", -1)) > self._cleared_through_step
        ]
        rows = [r for r in history.get("requests") or [] if int(r["uid"]) not in self._cleared_uids]
        # keep what this store has from before the server's shorter history
        first = int(steps[0]["step"]) if steps else None
        older = [s for s in fold.steps if first is None or int(s["step"]) < first]
        ended = {r.uid: r for r in fold.requests() if r.ended}
        lost, gaps = fold.lost, fold.gaps
        fold.load_hello({**msg, "history": {"steps": [*older, *steps], "requests": rows}})
        if not restarted:
            fold.lost, fold.gaps = lost, gaps
            for uid, rec in ended.items():  # ended requests the server no longer remembers
                if fold.get(uid) is None:
                    fold._remember_ended(rec)
        self._step_versions.clear()
        self._step_versions.extend([self._version] * len(fold.steps))
        self._reset_version = self._version
        for r in rows:
            self._touch(int(r["uid"]))
        if fold.steps:
            self._last_t = max(self._last_t, float(fold.steps[-1].get("t1", 0.0)))
        self._last_t = max(self._last_t, now)
        kv = [m for m in history.get("kv_events") or [] if isinstance(m, dict)]
        if kv:  # the watch's recent batches; keep ours from before them
            first_kv = kv[0].get("kv_seq", -1)
            older_kv = [m for m in self._kv_events if m.get("kv_seq", -1) < first_kv]
            self._kv_events.clear()
            self._kv_events.extend([*older_kv, *kv])

    def _reset(self) -> None:
        self._fold = _new_fold(self._fold.steps.maxlen)
        self._kept_waits.clear()
        self._kept_wait_count = 0
        self._step_versions.clear()
        self._changed.clear()
        self._log.clear()
        self._kv_events.clear()
        self._last_t = float("-inf")
        self._cleared_through_step = -1
        self._cleared_uids.clear()
        self.resyncs = 0

    def clear(self) -> None:
        """Forget recorded steps and ended requests; requests in flight keep their records."""
        with self._lock:
            fold = self._fold
            if fold.steps:
                self._cleared_through_step = int(fold.steps[-1]["step"])
            fold.steps.clear()
            self._step_versions.clear()
            self._log.clear()
            self._kv_events.clear()
            for rec in fold.requests():
                if rec.ended:
                    self._cleared_uids.add(rec.uid)
            fold._ended.clear()
            fold._ended_bytes = 0
            self._kept_waits.clear()
            self._kept_wait_count = 0
            self._version += 1
            self._reset_version = self._version
            self._stepped.notify_all()

    # ---- reading (any thread) ------------------------------------------------------------

    def snapshot(self, last_steps: int | None = None) -> Snapshot:
        with self._lock:
            fold = self._fold
            n = len(fold.steps)
            if last_steps is None or last_steps >= n:
                steps = list(fold.steps)
            elif last_steps <= 0:
                steps = []
            else:
                steps = [fold.steps[i] for i in range(n - last_steps, n)]
            requests = sorted(fold.requests(), key=lambda r: r.uid)
            return Snapshot(
                steps=steps,
                requests=[r.to_dict() for r in requests],
                engine=dict(fold.engine) if fold.engine is not None else None,
                config=dict(fold.config) if fold.config else None,
                version=self._version,
                messages_seen=self._seen,
                lost=fold.lost,
                resyncs=self.resyncs,
                restarts=self.restarts,
                kv_events=list(self._kv_events),
            )

    def delta(self, cursor: int | None, metrics: bool = True) -> Delta:
        """What is new since `cursor` (None: everything kept). Work in proportion to what
        changed, not to what is kept; `metrics=False` leaves the records' metrics and text out,
        so a record costs the same however many tokens it has."""
        with self._lock:
            fold = self._fold
            reset = cursor is None or cursor < self._reset_version
            if reset:
                steps = list(fold.steps)
                uids = sorted(r.uid for r in fold.requests())
            else:
                k = 0
                for v in reversed(self._step_versions):
                    if v <= cursor:  # type: ignore[operator]
                        break
                    k += 1
                n = len(fold.steps)
                steps = [fold.steps[i] for i in range(n - k, n)]
                uids = []
                for uid in reversed(self._changed):
                    if self._changed[uid] <= cursor:  # type: ignore[operator]
                        break
                    uids.append(uid)
                uids.reverse()
            records = [rec.to_dict(metrics) for uid in uids if (rec := fold.get(uid)) is not None]
            return Delta(
                cursor=self._version,
                reset=reset,
                history=self._reset_version,
                steps=steps,
                requests=records,
                engine=dict(fold.engine) if fold.engine is not None else None,
                config=dict(fold.config) if fold.config else None,
                lost=fold.lost,
                resyncs=self.resyncs,
                instance=fold.instance,
                restarted=cursor is not None and cursor < self._restart_version,
            )

    # ---- the delay (instrumentation.blame, over the fold) ---------------------------------

    def delays(self) -> dict[int, Delay]:
        """Each request's delay by uid, oldest first: final once it ended, so far while in
        flight (instrumentation.blame.request_delay); `blame()` of it is who delayed whom."""
        with self._lock:
            fold = self._fold
            out: dict[int, Delay] = {}
            for rec in sorted(fold.requests(), key=lambda r: r.uid):
                d = request_delay(fold, rec.uid)
                if d is not None:
                    out[rec.uid] = d
            return out

    def stall_cause(
        self, summary: Summary, uid: int, seconds: float, ongoing: bool
    ) -> StallCause | None:
        """The main cause of the headline's worst stall: `summary`'s, or (`ongoing`) `uid`'s
        current wait of `seconds`."""
        with self._lock:
            if ongoing:
                return stall_cause(uid, seconds, request_wait(self._fold, uid))
            return worst_stall_cause(self._fold, summary)

    def describe_waits(
        self,
        ended: Iterable[tuple[int, int]] = (),
        current: Iterable[int] = (),
        first: Iterable[int] = (),
    ) -> tuple[dict[tuple[int, int], str], dict[int, str], dict[int, str]]:
        """Waits in words (`GapDelay.describe()`): those that a request's token in a step ended
        (`ended`: (uid, step)), requests' current waits, and their waits for a first token;
        those not known are left out."""
        with self._lock:
            fold = self._fold
            got = {k: request_wait(fold, k[0], step=k[1]) for k in ended}
            now = {uid: request_wait(fold, uid) for uid in current}
            firsts = {uid: request_wait(fold, uid, index=0) for uid in first}
            return (
                {k: g.describe() for k, g in got.items() if g is not None},
                {u: g.describe() for u, g in now.items() if g is not None},
                {u: g.describe() for u, g in firsts.items() if g is not None and not g.ongoing},
            )

    def log(self) -> list[Message]:
        """Every recorded message, oldest first (the session trace)."""
        with self._lock:
            return list(self._log)

    @property
    def version(self) -> int:
        return self._version

    def wait_reply(self, command_id: str, timeout: float) -> Message | None:
        """The `accepted`, `config` or `error` message echoing `command_id`, or None on timeout."""
        with self._replied:
            self._replied.wait_for(lambda: command_id in self._replies, timeout=timeout)
            return self._replies.get(command_id)

    def wait_for_step(self, after: int, timeout: float) -> bool:
        """Until a step newer than version `after` is folded or the history is replaced (the
        live charts' pull waits here instead of polling); False on timeout."""

        def news() -> bool:
            last = self._step_versions[-1] if self._step_versions else -1
            return last > after or self._reset_version > after

        with self._stepped:
            return self._stepped.wait_for(news, timeout=timeout)

    def reply(self, command_id: str) -> Message | None:
        with self._lock:
            return self._replies.get(command_id)


def _new_fold(max_steps: int | None) -> Fold:
    return Fold(
        max_steps=max_steps,
        max_ended=MAX_ENDED_REQUESTS,
        max_ended_bytes=MAX_ENDED_BYTES,
        delays=True,
    )


__all__ = ["ENDED_STATES", "Delta", "EventStore", "Message", "Snapshot"]
