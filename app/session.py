"""Per-browser-tab state: what this tab shows (live or paused, window, x axis) and its notices.

The engine link and its store are shared by every tab; this module holds only what differs
between tabs, in `st.session_state`. Reads of the store here are bounded: a redraw copies the
steps it draws (at most `cap`), and engine facts come from a per-tab cursor, so a long history
is not copied several times a second.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import streamlit as st

from app import controls
from app.client import EngineLink, NotConnected
from app.state import Message, Snapshot
from app.workloads import PROMPT_PRESET, PresetRun

WINDOWS: tuple[int | str, ...] = (100, 250, 500, 1000, 2000, 5000, "all")
DEFAULT_WINDOW = 500
ALL_STEPS = 20_000  # "all": what the store keeps
METRIC_STEPS = 200  # the metric row summarizes the newest steps (bounded: it runs every second)
MAX_NOTICES = 6
MAX_RUNS = 4


@dataclass(frozen=True)
class Notice:
    """A command's outcome on this tab's status line. A `held` notice stands while its run waits
    for the engine to come up; once the run has reached the engine, `settle_held` replaces it
    with what became of it."""

    ok: bool
    text: str
    held: PresetRun | None = None


def notices() -> list[Notice]:
    return st.session_state.setdefault("notices", [])


def notify(ok: bool, text: str, toast: bool = False) -> None:
    """Record a command's outcome for this tab's status line. `toast` repeats it in the corner,
    for controls far below that line (Abort): a toast elsewhere would cover the form's Submit
    button, and one under the pointer never expires."""
    items = notices()
    items.append(Notice(ok, text))
    del items[:-MAX_NOTICES]
    if toast:
        unshown = st.session_state.get("unshown_toasts", [])
        st.session_state["unshown_toasts"] = [*unshown, (ok, text)]
    # The status line lives outside the fragments: a control inside one (Abort) reruns only its
    # fragment, which then asks for the whole page (`show_notices_now`).
    st.session_state["notice_unshown"] = True


def hold(run: PresetRun, text: str) -> None:
    """A run waiting for the engine (a prompt or workload sent before it was up): say so until
    it has reached the engine."""
    add_run(run)
    notify(True, text)
    items = notices()
    items[-1] = Notice(True, text, held=run)


def _settled(notice: Notice) -> Notice | None:
    """What a held notice becomes once its run reached the engine (None: still held)."""
    run = notice.held
    if run is None:
        return None
    if run.errors:
        return Notice(False, f"{run.preset.title}: {'; '.join(run.errors)}")
    if run.preset.key == PROMPT_PRESET and run.finished:
        uids = ", ".join(map(str, run.uids))
        return Notice(True, f"submitted: request {uids} (held until the engine was up)")
    if run.preset.key != PROMPT_PRESET and run.done_actions > 0:
        return Notice(True, f"workload “{run.preset.title}” started (the engine is up)")
    return None


def held_outdated() -> bool:
    """A held notice on the page whose run has since reached the engine."""
    return any(_settled(n) is not None for n in notices())


def settle_held() -> None:
    """At the start of a full page run: replace held notices whose runs reached the engine."""
    items = notices()
    for k, notice in enumerate(items):
        if (settled := _settled(notice)) is not None:
            items[k] = settled


def controls_waiting(waiting: bool) -> None:
    """The full page drew the sidebar without the scheduling controls (no engine config yet)."""
    st.session_state["controls_waiting"] = waiting


def controls_outdated(link: EngineLink) -> bool:
    """The page was drawn before the engine's config arrived, and it has arrived since: the
    controls the full page draws are missing until it runs again."""
    return bool(st.session_state.get("controls_waiting")) and engine_facts(link)[1] is not None


def show_notices_now() -> None:
    """In a fragment: if a control in it left a notice, rerun the page so the notice shows."""
    if st.session_state.pop("notice_unshown", False):
        st.rerun()


def send(link: EngineLink, command: Message, what: str, toast: bool = False) -> Message | None:
    """Send a command, wait for its reply, and report the outcome as a notice."""
    try:
        reply = link.request(command)
    except NotConnected as exc:
        notify(False, f"{what}: {exc}", toast)
        return None
    ok, text = controls.describe_reply(reply, command)
    notify(ok, f"{what}: {text}", toast)
    return reply


def submit_now(link: EngineLink, commands: list[Message]) -> None:
    """Send submits, wait for their replies, and say which requests they became."""
    ids = []
    for cmd in commands:
        try:
            ids.append(link.send(cmd))
        except RuntimeError as exc:
            notify(False, f"submit: {exc}")
            return
    uids, errors = [], []
    for cid in ids:
        ok, msg = controls.describe_reply(reply := link.store.wait_reply(cid, 3.0))
        if ok and reply is not None:
            uids.append(str(reply["uid"]))
        else:
            errors.append(msg)
    if uids:
        notify(True, f"submitted: request {', '.join(uids)}")
    for msg in errors:
        notify(False, f"submit: {msg}")


def add_run(run: PresetRun) -> None:
    runs = st.session_state.setdefault("preset_runs", [])
    runs.append(run)
    del runs[:-MAX_RUNS]


def is_live() -> bool:
    return bool(st.session_state.get("live", True))


def window_steps() -> int | None:
    window = st.session_state.get("window", DEFAULT_WINDOW)
    return None if window == "all" else int(window)


def view_snapshot(link: EngineLink, cap: int | None = None) -> Snapshot:
    """The data this tab draws: a frozen copy while paused, else the last `window` steps."""
    n = window_steps()
    if cap is not None:
        n = cap if n is None else min(n, cap)
    frozen: Snapshot | None = st.session_state.get("frozen")
    if is_live() or frozen is None:
        return link.store.snapshot(last_steps=n)
    inspect = st.session_state.get("inspect")
    if inspect is not None:
        steps = [s for s in frozen.steps if inspect[0] <= s["step"] <= inspect[1]]
    else:
        steps = frozen.steps if n is None else frozen.steps[-n:] if n > 0 else []
    return Snapshot(steps, frozen.requests, frozen.engine, frozen.config, frozen.version,
                    kv_events=frozen.kv_events)  # fmt: skip


class TabBook:
    """What this tab's once-a-second views read: the newest steps and every request's record
    (without metrics or text), kept up to date from the store's deltas, so a refresh costs what
    arrived since the last one, not the history."""

    def __init__(self, max_steps: int = METRIC_STEPS, max_requests: int = 2_000) -> None:
        self.cursor: int | None = None
        self.steps: deque[Message] = deque(maxlen=max_steps)
        self.requests: dict[int, Message] = {}
        self.max_requests = max_requests
        self.engine: dict[str, Any] = {}
        self.config: dict[str, Any] | None = None
        self.lost = self.resyncs = self.restarts = 0
        self.version = 0

    def refresh(self, store: Any) -> TabBook:
        delta = store.delta(self.cursor, metrics=False)
        if delta.reset:
            self.steps.clear()
            self.requests.clear()
        self.restarts += int(delta.restarted)
        self.cursor = delta.cursor
        self.steps.extend(delta.steps)
        for rec in delta.requests:
            self.requests.pop(int(rec["uid"]), None)  # re-inserted: newest last
            self.requests[int(rec["uid"])] = rec
        while len(self.requests) > self.max_requests:
            del self.requests[next(iter(self.requests))]
        self.engine, self.config = delta.engine or {}, delta.config
        self.lost, self.resyncs, self.version = delta.lost, delta.resyncs, delta.cursor
        return self

    def snapshot(self) -> Snapshot:
        return Snapshot(
            list(self.steps),
            sorted(self.requests.values(), key=lambda r: int(r["uid"])),
            self.engine,
            self.config,
            self.version,
            lost=self.lost,
            resyncs=self.resyncs,
            restarts=self.restarts,
        )


def book(link: EngineLink) -> TabBook:
    books: dict[int, TabBook] = st.session_state.setdefault("tab_books", {})
    return books.setdefault(id(link.store), TabBook()).refresh(link.store)


def metrics_snapshot(link: EngineLink) -> Snapshot:
    frozen: Snapshot | None = st.session_state.get("frozen")
    if not is_live() and frozen is not None:
        return view_snapshot(link, cap=METRIC_STEPS)
    return book(link).snapshot()


def requests_snapshot(link: EngineLink) -> list[Message]:
    """The records with their text (the output view), read through this tab's cursor."""
    seen: dict[int, Message] = st.session_state.setdefault("text_records", {})
    delta = link.store.delta(st.session_state.get("text_cursor"), metrics=True)
    if delta.reset:
        seen.clear()
    st.session_state["text_cursor"] = delta.cursor
    for rec in delta.requests:
        seen.pop(int(rec["uid"]), None)
        seen[int(rec["uid"])] = rec
    while len(seen) > 64:  # the view shows the newest few
        del seen[next(iter(seen))]
    return sorted(seen.values(), key=lambda r: int(r["uid"]))


def engine_facts(link: EngineLink) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The engine's description and config, read through this tab's cursor: the cost is what
    arrived since the last read, not the history."""
    delta = link.store.delta(st.session_state.get("facts_cursor"), metrics=False)
    st.session_state["facts_cursor"] = delta.cursor
    return delta.engine or {}, delta.config


def freeze(link: EngineLink) -> None:
    """The live toggle's callback: pausing keeps a copy so charts stop changing under the mouse."""
    if is_live():
        st.session_state["frozen"] = None
        st.session_state.pop("inspect", None)
    else:
        st.session_state["frozen"] = link.store.snapshot()
