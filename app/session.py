"""This tab's state: every `st.session_state` key of the page, and what is built on them.

`st.session_state` is reached here and nowhere else (a test checks it). Each key is a typed
`Field` named below, widget keys included (`key=session.URL.key`): a key is spelled once, and
what it holds says so. The engine link and its store are shared by every tab; this module holds
only what differs between tabs: what the tab shows (live or paused, window, x axis), its
notices, its cursors into the store, and the open recording.

Reads of the store here are bounded: a redraw copies the steps it draws (at most `cap`), and
engine facts come from a per-tab cursor, so a long history is not copied several times a second.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import streamlit as st

from app import controls
from app.client import EngineLink, NotConnected
from app.replay import SPEEDS
from app.state import Message, Snapshot
from app.workloads import PROMPT_PRESET, PresetRun

if TYPE_CHECKING:
    pass

WINDOWS: tuple[int | str, ...] = (100, 250, 500, 1000, 2000, 5000, "all")
DEFAULT_WINDOW = 500
DEFAULT_BUDGET = 256
ALL_STEPS = 20_000  # "all": what the store keeps
MAX_NOTICES = 6
MAX_RUNS = 4

T = TypeVar("T")


class Field(Generic[T]):
    """One key of this tab's `st.session_state`, with its type and its default.

    `get()` reads it (the default if unset, without storing it); `setdefault()` stores the
    default first (for containers the caller mutates, and widgets that need a value); `set`,
    `pop`, `present` as their names say. A widget is bound with `key=FIELD.key`; a number box
    also gets `value=FIELD.default()`, since a browser that loses a widget's state shows the
    default the widget declared, and a number box's own is 0 (copies 0, max_tokens 0)."""

    __slots__ = ("key", "_default", "_factory")

    def __init__(
        self, key: str, default: T | None = None, factory: Callable[[], T] | None = None
    ) -> None:
        self.key = key
        self._default = default
        self._factory = factory

    def default(self) -> T:
        if self._factory is not None:
            return self._factory()
        return self._default  # type: ignore[return-value]  # None for an optional field

    def get(self) -> T:
        ss = st.session_state
        return ss[self.key] if self.key in ss else self.default()

    def setdefault(self) -> T:
        return st.session_state.setdefault(self.key, self.default())

    def set(self, value: T) -> None:
        st.session_state[self.key] = value

    def pop(self) -> T:
        return st.session_state.pop(self.key, self.default())

    def present(self) -> bool:
        return self.key in st.session_state


# ---- the keys ---------------------------------------------------------------------------------

# the engine
URL = Field[str]("url", "")  # widget: the engine URL every tab follows
PAGE_MODE = Field["ExternalMode | None"]("page_mode")  # what the last full run drew for
MODE_CURSOR = Field["int | None"]("mode_cursor")
FACTS_CURSOR = Field["int | None"]("facts_cursor")
# the prompt form's widgets
PROMPT_TEXT = Field[str]("prompt_text", "")
MAX_TOKENS = Field[int]("max_tokens", 64)
TEMPERATURE = Field[float]("temperature", 0.0)
COPIES = Field[int]("copies", 1)
CHAT = Field[bool]("chat", True)
IGNORE_EOS = Field[bool]("ignore_eos", False)
# scheduling: the widgets, the config they were synced to, and what this tab set
BUDGET_SLIDER = Field[int]("budget_slider", DEFAULT_BUDGET)
BUDGET_EXACT = Field[str]("budget_exact", str(DEFAULT_BUDGET))  # a text box: refused, not clamped
POLICY = Field[str]("policy", controls.POLICIES[0])
ADMISSION = Field[str]("admission", controls.ADMISSIONS[0])
# notices and runs
NOTICES = Field["list[Notice]"]("notices", factory=list)
UNSHOWN_TOASTS = Field["list[tuple[bool, str]]"]("unshown_toasts", factory=list)
PRESET_RUNS = Field["list[PresetRun]"]("preset_runs", factory=list)
OPENAI_SUBMITS = Field["list[OpenAISubmit]"]("openai_submits", factory=list)
CLEAR = Field[bool]("clear_history", False)  # the button
# Streamlit's rerun workarounds: app/rerun.py says why each exists
CONTROLS_WAITING = Field[bool]("controls_waiting", False)  # drawn without the engine's config
FULL_RUN = Field[bool]("full_run", False)  # a full page run is under way (not a fragment's)
FULL_RUN_END = Field[float]("full_run_end", 0.0)  # when the last full run ended (monotonic s)
TICKS_SINCE_FULL_RUN = Field[int]("ticks_since_full_run", 0)  # fragment checks since then
NOTICE_UNSHOWN = Field[bool]("notice_unshown", False)  # a fragment left a notice
SYNCED_CONFIG = Field["dict[str, Any] | None"]("synced_config")  # what the controls show
OWN_CONFIGS = Field["list[tuple[dict[str, Any], float]]"]("own_configs", factory=list)
# a control's value from before a sync, and when it was replaced: (value, monotonic time)
STALE = {
    "max_extend_tokens": Field["tuple[Any, float] | None"]("stale_max_extend_tokens"),
    "policy": Field["tuple[Any, float] | None"]("stale_policy"),
    "admission": Field["tuple[Any, float] | None"]("stale_admission"),
}
# the view
LIVE = Field[bool]("live", True)  # widget
WINDOW = Field["int | str"]("window", DEFAULT_WINDOW)  # widget
XMODE = Field[str]("xmode", "step")  # widget
FROZEN = Field["Snapshot | None"]("frozen")  # the copy shown while paused
TAB_BOOKS = Field["dict[int, TabBook]"]("tab_books", factory=dict)
TEXT_RECORDS = Field["dict[int, Message]"]("text_records", factory=dict)
TEXT_CURSOR = Field["int | None"]("text_cursor")
FIGURE_MEMO = Field["dict[str, tuple[tuple, Any]]"]("figure_memo", factory=dict)
RESTARTS_SEEN = Field["int | None"]("restarts_seen")
LIVE_FEEDS = Field["dict[str, LiveFeed]"]("live_feeds", factory=dict)
LIVE_SEEN = Field["dict[str, tuple[Any, list]]"]("live_seen", factory=dict)
LIVE_SENT_POLICY = Field["dict[str, Any]"]("live_sent_policy", factory=dict)
# a recording's batches for the live component, by view: (what they were built from, batch)
RECORDING_BATCHES = Field["dict[str, tuple[tuple, dict]]"]("recording_batches", factory=dict)
# replay, compare and sweep: what app/opener.py opened, for the pages under app/page/
REPLAY_SOURCE = Field["ReplaySource | None"]("replay_source")
REPLAY_COMPARE = Field["Recording | None"]("replay_compare")
REPLAY_SWEEP = Field["SweepFolder | None"]("replay_sweep")
REPLAY_ERROR = Field["str | None"]("replay_error")
REPLAY_ARGV_DONE = Field[bool]("replay_argv_done", False)  # `--trace FILE` was opened once
REPLAY_PATH_TRIED = Field[str]("replay_path_tried", "")  # the Open recording box, last acted on
REPLAY_STEP_SHOWN = Field["int | None"]("replay_step_shown")  # the scrubber's step, last known
REPLAY_SCRUB_LOCKED = Field[bool]("replay_scrub_locked", False)  # the scrubber last drawn disabled
REPLAY_PATH = Field[str]("replay_path", "")  # widgets from here on
REPLAY_UPLOAD = Field[Any]("replay_upload")
COMPARE_PATH = Field[str]("compare_path", "")
COMPARE_UPLOAD = Field[Any]("compare_upload")
SWEEP_PATH = Field[str]("sweep_path", "")
SWEEP_CHART = Field[Any]("sweep_chart")  # the trade-off plot's selection event
REPLAY_STEP = Field["int | None"]("replay_step")
REPLAY_SPEED = Field[int]("replay_speed", SPEEDS[0])

# what belongs to the shown source (the engine, or a recording): a new one starts them afresh,
# as a new engine would
VIEW_FIELDS: tuple[Field[Any], ...] = (
    LIVE_FEEDS, LIVE_SENT_POLICY, FACTS_CURSOR, FROZEN, FIGURE_MEMO, RECORDING_BATCHES,
    SYNCED_CONFIG, RESTARTS_SEEN,
)  # fmt: skip


def component_value(key: str) -> Any:
    """A component's value, stored under its own key by Streamlit (the live charts' pulls)."""
    return st.session_state.get(key)


def reset_views(keep_live: bool = False) -> None:
    """Forget what the tab drew of the previous source (the charts start afresh, their zoom
    too), and show the new one live unless `keep_live`."""
    for field in VIEW_FIELDS:
        field.pop()
    if not keep_live:
        LIVE.set(True)


@dataclass(frozen=True)
class Notice:
    """A command's outcome on this tab's status line. A `held` notice stands while its run waits
    for the engine to come up; once the run has reached the engine, `settle_held` replaces it
    with what became of it."""

    ok: bool
    text: str
    held: PresetRun | None = None


def notices() -> list[Notice]:
    return NOTICES.setdefault()


def notify(ok: bool, text: str, toast: bool = False, held: PresetRun | None = None) -> None:
    """Record a command's outcome for this tab's status line. `toast` repeats it in the corner,
    for controls far below that line (Abort): a toast elsewhere would cover the form's Submit
    button, and one under the pointer never expires. `held`: see `Notice`."""
    items = notices()
    items.append(Notice(ok, text, held))
    del items[:-MAX_NOTICES]
    if toast:
        UNSHOWN_TOASTS.set([*UNSHOWN_TOASTS.get(), (ok, text)])
    # The status line lives outside the fragments: a control inside one (Abort) reruns only its
    # fragment, which then asks for the whole page (`show_notices_now`).
    NOTICE_UNSHOWN.set(True)


def hold(run: PresetRun, text: str) -> None:
    """A run waiting for the engine (a prompt or workload sent before it was up): say so until
    it has reached the engine."""
    add_run(run)
    notify(True, text, held=run)


def settled(notice: Notice) -> Notice | None:
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


def settle_held() -> None:
    """At the start of a full page run: replace held notices whose runs reached the engine."""
    items = notices()
    for k, notice in enumerate(items):
        if (done := settled(notice)) is not None:
            items[k] = done


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
    runs = PRESET_RUNS.setdefault()
    runs.append(run)
    del runs[:-MAX_RUNS]


def is_live() -> bool:
    return bool(LIVE.get())


def window_steps() -> int | None:
    window = WINDOW.get()
    return None if window == "all" else int(window)


def view_snapshot(link: EngineLink, cap: int | None = None) -> Snapshot:
    """The data this tab draws: a frozen copy while paused, else the last `window` steps."""
    n = window_steps()
    if cap is not None:
        n = cap if n is None else min(n, cap)
    frozen = FROZEN.get()
    if is_live() or frozen is None:
        return link.store.snapshot(last_steps=n)
    steps = frozen.steps if n is None else frozen.steps[-n:] if n > 0 else []
    return Snapshot(steps, frozen.requests, frozen.engine, frozen.config, frozen.version,
                    kv_events=frozen.kv_events)  # fmt: skip


class TabBook:
    """What this tab's once-a-second views read: the newest steps and every request's record
    (without metrics or text), kept up to date from the store's deltas, so a refresh costs what
    arrived since the last one, not the history."""

    def __init__(self, max_steps: int = ALL_STEPS, max_requests: int = 2_000) -> None:
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

    def snapshot(self, last_steps: int | None = None) -> Snapshot:
        n = len(self.steps) if last_steps is None else min(last_steps, len(self.steps))
        return Snapshot(
            list(itertools.islice(self.steps, len(self.steps) - n, None)),
            sorted(self.requests.values(), key=lambda r: int(r["uid"])),
            self.engine,
            self.config,
            self.version,
            lost=self.lost,
            resyncs=self.resyncs,
            restarts=self.restarts,
        )


def book(link: EngineLink) -> TabBook:
    books = TAB_BOOKS.setdefault()
    return books.setdefault(id(link.store), TabBook()).refresh(link.store)


def metrics_snapshot(link: EngineLink) -> Snapshot:
    """What the headline summarizes: the steps in view (the charts' window), as they are drawn
    (frozen while paused)."""
    frozen = FROZEN.get()
    if not is_live() and frozen is not None:
        return view_snapshot(link)
    return book(link).snapshot(last_steps=window_steps())


def requests_snapshot(link: EngineLink) -> list[Message]:
    """The records with their text (the output view), read through this tab's cursor."""
    seen = TEXT_RECORDS.setdefault()
    delta = link.store.delta(TEXT_CURSOR.get(), metrics=True)
    if delta.reset:
        seen.clear()
    TEXT_CURSOR.set(delta.cursor)
    for rec in delta.requests:
        seen.pop(int(rec["uid"]), None)
        seen[int(rec["uid"])] = rec
    while len(seen) > 64:  # the view shows the newest few
        del seen[next(iter(seen))]
    return sorted(seen.values(), key=lambda r: int(r["uid"]))


def engine_facts(link: EngineLink) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The engine's description and config, read through this tab's cursor: the cost is what
    arrived since the last read, not the history."""
    delta = link.store.delta(FACTS_CURSOR.get(), metrics=False)
    FACTS_CURSOR.set(delta.cursor)
    return delta.engine or {}, delta.config


def freeze(link: EngineLink) -> None:
    """The live toggle's callback: pausing keeps a copy so charts stop changing under the mouse."""
    if is_live():
        FROZEN.set(None)
    else:
        FROZEN.set(link.store.snapshot())
