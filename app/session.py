"""Per-browser-tab state: what this tab shows (live or paused, window, x axis) and its notices.

The engine link and its store are shared by every tab; this module holds only what differs
between tabs, in `st.session_state`.
"""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from app import controls
from app.client import EngineLink, NotConnected
from app.state import Message, Snapshot

WINDOWS: tuple[int | str, ...] = (100, 250, 500, 1000, 2000, 5000, "all")
DEFAULT_WINDOW = 500
MAX_NOTICES = 6


@dataclass(frozen=True)
class Notice:
    ok: bool
    text: str


def notices() -> list[Notice]:
    return st.session_state.setdefault("notices", [])


def notify(ok: bool, text: str) -> None:
    """Record a command's outcome for this tab's status line (shown as a toast, too)."""
    items = notices()
    items.append(Notice(ok, text))
    del items[:-MAX_NOTICES]
    st.session_state["unshown_toasts"] = [*st.session_state.get("unshown_toasts", []), (ok, text)]


def send(link: EngineLink, command: Message, what: str) -> Message | None:
    """Send a command, wait for its reply, and report the outcome as a notice."""
    try:
        reply = link.request(command)
    except NotConnected as exc:
        notify(False, f"{what}: {exc}")
        return None
    ok, text = controls.describe_reply(reply)
    notify(ok, f"{what}: {text}")
    return reply


def is_live() -> bool:
    return bool(st.session_state.get("live", True))


def window_steps() -> int | None:
    window = st.session_state.get("window", DEFAULT_WINDOW)
    return None if window == "all" else int(window)


def view_snapshot(link: EngineLink) -> Snapshot:
    """The data this tab draws: a frozen copy while paused, else the last `window` steps."""
    frozen: Snapshot | None = st.session_state.get("frozen")
    if is_live() or frozen is None:
        return link.store.snapshot(last_steps=window_steps())
    inspect = st.session_state.get("inspect")
    if inspect is not None:
        steps = [s for s in frozen.steps if inspect[0] <= s["step"] <= inspect[1]]
    else:
        n = window_steps()
        steps = frozen.steps if n is None else frozen.steps[-n:]
    return Snapshot(steps, frozen.requests, frozen.engine, frozen.config, frozen.version)


def freeze(link: EngineLink) -> None:
    """The live toggle's callback: pausing keeps a copy so charts stop changing under the mouse."""
    if is_live():
        st.session_state["frozen"] = None
        st.session_state.pop("inspect", None)
    else:
        st.session_state["frozen"] = link.store.snapshot()
