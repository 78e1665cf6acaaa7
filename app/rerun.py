"""Streamlit's rerun model, and every workaround the page needs for it, in one place.

A Streamlit page is a script run top to bottom on each interaction; fragments rerun parts of it
on their own timers. Four consequences need care, and each has its one function here:

1. **A fragment cannot redraw what only a full run draws** (the sidebar's scheduling controls,
   the status line). When such a thing goes out of date (the engine's config arrived, a held
   prompt reached the engine, a notice was left by a control inside a fragment), a fragment asks
   for one full run: `page_outdated`, `show_notices_now`. Asking at the wrong moment loses
   input, so `may_ask_full_run` says when it is safe (`FULL_RUN`, `FULL_RUN_END`,
   `TICKS_SINCE_FULL_RUN`).
2. **A widget's value can come back from before a sync.** The browser may send a rerun that
   started before the controls were synced to the engine's config; that stale value is not the
   user's choice (`STALE`, `stale`). And the store folds the engine's config broadcasts on
   another thread, so for a moment it may still show an older config this tab set itself
   (`OWN_CONFIGS`, `lagging`).
3. **The first full run should not be drawn half-known.** An engine that is up answers within a
   moment; waiting for its hello (`await_hello`) draws the controls at once, instead of a second
   whole-app run asked for while the charts pull (which once froze them).
4. **A fragment run must not cut the full run before it short** (`keep_full_runs_whole`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import streamlit as st

from app import controls, session
from app.client import EngineLink

SETTLE_S = 1.0  # after a full run, before a fragment may ask for the next one
HELLO_WAIT_S = 2.0  # a full run waits this long at most for a connecting engine's hello
STALE_S = 3.0  # how long a value from before a sync may still come back from the browser
SYNCED = ("max_extend_tokens", "policy", "admission")


# ---- 1. full runs asked for by fragments ------------------------------------------------------


@contextmanager
def full_run() -> Iterator[None]:
    """Wrap the whole script's run: while it runs no fragment asks for another, and the time it
    ended starts the settle period (`may_ask_full_run`)."""
    session.FULL_RUN.set(True)
    try:
        yield
    finally:  # also when a rerun or an error ends this run early
        session.FULL_RUN.set(False)
        session.FULL_RUN_END.set(time.monotonic())
        session.TICKS_SINCE_FULL_RUN.set(0)


def may_ask_full_run() -> bool:
    """Whether a fragment may ask for a whole-app run now. Never during a full run (it draws the
    page anyway, and a rerun would drop what started it, a form's Submit); nor while the browser
    may still be mounting what the last full run drew: a whole-app rerun asked for then went out
    with the new widgets at their first values (seen: Live off and 100 steps in view, so the
    charts froze after their first update; on the fleet page, a third chart for two replicas).
    Nor from the first timed fragment run after it: that run is the browser's first word since
    it drew the page."""
    if session.FULL_RUN.get():
        return False
    ticks = session.TICKS_SINCE_FULL_RUN.get() + 1
    session.TICKS_SINCE_FULL_RUN.set(ticks)
    return ticks >= 2 and time.monotonic() - session.FULL_RUN_END.get() >= SETTLE_S


def page_outdated(link: EngineLink, mode_now: Callable[[EngineLink], Any]) -> bool:
    """What the engine's page (live or watched, the only callers) draws has changed since it
    last ran, and no fragment draws it: the engine turned out external (or not), its config
    arrived (the scheduling controls), a held prompt reached it (its notice), or a recording
    waits to be opened or was opened meanwhile (a widget's callback run with a fragment's rerun
    opens it, and only a full run draws its page)."""
    if not may_ask_full_run():
        return False
    return (
        mode_now(link) != session.PAGE_MODE.get()
        or controls_outdated(link)
        or held_outdated()
        or path_unopened()
        or session.REPLAY_SOURCE.get() is not None
        or session.REPLAY_SWEEP.get() is not None
    )


def path_unopened() -> bool:
    """A path in the "Open recording" box that reached the box's value without its on_change
    (entered while a fragment reran: the box showed it, nothing opened, and Enter again changed
    nothing). A full run opens it (app/opener.py); on an idle page only a fragment asks for one."""
    path = str(session.REPLAY_PATH.get() or "").strip()
    return bool(path) and path != session.REPLAY_PATH_TRIED.get()


def redraw_when_outdated(link: EngineLink, mode_now: Callable[[EngineLink], Any]) -> None:
    """In a fragment: ask for the full page once what it shows is outdated."""
    if page_outdated(link, mode_now):
        st.rerun(scope="app")


def show_notices_now() -> None:
    """In a fragment: if a control left a notice, rerun the page so the notice shows. The flag
    stays until a full run draws the status line (`session.take_notices`): a rerun asked for
    here can be lost (Streamlit keeps only the newest of the requests that race it, and the live
    charts ask several times a second), and the next run of this fragment asks again."""
    if session.NOTICE_UNSHOWN.get():
        st.rerun()


def controls_waiting(waiting: bool) -> None:
    """The full page drew the sidebar without the scheduling controls (no engine config yet)."""
    session.CONTROLS_WAITING.set(waiting)


def controls_outdated(link: EngineLink) -> bool:
    """The page was drawn before the engine's config arrived, and it has arrived since."""
    return session.CONTROLS_WAITING.get() and session.engine_facts(link)[1] is not None


def held_outdated() -> bool:
    """A held notice on the page whose run has since reached the engine."""
    return any(session.settled(n) is not None for n in session.notices())


def awaiting_engine() -> bool:
    """This run drew the page before the engine was ready for it: the scheduling controls are
    missing, or a notice says a prompt or workload is held."""
    return session.CONTROLS_WAITING.get() or any(n.held is not None for n in session.notices())


# ---- 2. widget values from before a sync ------------------------------------------------------


def remember_own(config: dict[str, Any]) -> None:
    """A config this tab set and the engine confirmed: the controls show it from now on, and an
    older one of this tab's still shown by the store is not taken for a change elsewhere."""
    session.SYNCED_CONFIG.set(config)
    mine = session.OWN_CONFIGS.setdefault()
    mine.append((config, time.monotonic()))
    del mine[:-8]


def replaced(field: str) -> None:
    """A callback is about to change `field` from the value in force: the control it did not
    come from still shows that value in the browser until this run's reply reaches it, and a
    rerun started meanwhile sends it back as if chosen (seen: the exact box set 48, and the
    slider's 8 came back and set 8 again). `stale` turns such a value away."""
    old = (session.SYNCED_CONFIG.get() or {}).get(field)
    if old is not None:
        session.STALE[field].set((old, time.monotonic()))


def stale(field: str, value: object) -> bool:
    """A value the controls showed before they were synced to the engine's config, sent back by
    a rerun the browser started before the sync reached it (the live charts rerun their fragment
    several times a second). It is not the user's choice: put the synced one back."""
    old = session.STALE[field].get()
    if old is None or old[0] != value or time.monotonic() - old[1] > STALE_S:
        return False
    show_in_force(field)
    return True


def show_in_force(field: str) -> None:
    """Make the control of `field` show the engine's value in force, as last synced: not the
    widget's own value, which may be one the browser sent back from before the sync (seen: a
    refused budget entry put back the slider's 1, not the 48 in force)."""
    synced = session.SYNCED_CONFIG.get() or {}
    if synced.get(field) is not None:
        show(field, synced[field])


def show(field: str, value: Any) -> None:
    """Make the control of `field` show `value` (the budget has two: slider and exact box)."""
    if field == "max_extend_tokens":
        session.BUDGET_EXACT.set(str(value))
        session.BUDGET_SLIDER.set(int(value))
    elif field == "admission":
        session.ADMISSION.set(value)
    else:
        session.POLICY.set(value)


def lagging(config: dict[str, Any]) -> bool:
    """The engine's config as the store shows it is not the one this tab set last, and that
    change is recent: the store has not folded the newer broadcast yet (the reply to a
    set_config comes first). Seen: the budget back at 8, set by another tab before, a moment
    after this one set 48. A change made elsewhere meanwhile shows once STALE_S has passed."""
    mine = session.OWN_CONFIGS.get()
    if not mine or time.monotonic() - mine[-1][1] > STALE_S:
        return False
    return {k: config.get(k) for k in SYNCED} != mine[-1][0]


def sync_controls(config: dict[str, Any] | None) -> None:
    """Make the controls show the engine's config when it changed elsewhere (a preset, another
    tab), remembering each replaced value for `stale`."""
    session.BUDGET_EXACT.setdefault()
    if not session.BUDGET_SLIDER.present():
        session.BUDGET_SLIDER.set(int(session.DEFAULT_BUDGET))
    current = {
        "max_extend_tokens": session.BUDGET_SLIDER.get(),
        "policy": session.POLICY.setdefault(),
        "admission": session.ADMISSION.setdefault(),
    }
    if not config or not config.get("max_extend_tokens"):
        return
    if session.SYNCED_CONFIG.get() == config or lagging(config):
        return
    session.SYNCED_CONFIG.set(dict(config))
    now = time.monotonic()
    allowed = {"policy": controls.POLICIES, "admission": controls.ADMISSIONS}
    for field in SYNCED:
        value = config.get(field)
        if value is None or (field in allowed and value not in allowed[field]):
            continue
        if current[field] != value:
            session.STALE[field].set((current[field], now))
        show(field, value)


# ---- 3. the first full run --------------------------------------------------------------------


def await_hello(links: list[EngineLink]) -> None:
    """Wait (briefly) for each connecting engine's hello, so this full run draws the controls.
    Waits for the hello, not the config itself: a watch's hello has an empty config, and waiting
    on it held every full run of a watched engine's page for HELLO_WAIT_S."""
    deadline = time.monotonic() + HELLO_WAIT_S
    pending = list(links)
    while pending and time.monotonic() < deadline:
        pending = [link for link in pending if not _answered(link)]
        if pending:
            time.sleep(0.02)


def _answered(link: EngineLink) -> bool:
    snap = link.store.snapshot(last_steps=0)
    if snap.config is not None or snap.engine is not None:
        return True  # the hello is in: the engine's config (or that it has none)
    return link.status().state not in ("connecting", "connected")  # nothing answers (yet)


# ---- 4. a full run's messages, whole -------------------------------------------------------


def keep_full_runs_whole() -> None:
    """Keep a finished full run's messages whole when a fragment run starts before they left.

    When a run starts, Streamlit drops what the previous one left unsent in the session's
    outgoing queue; for a fragment run, only the deltas of the fragments it reruns. A full run
    that finished while the browser's fragment timers waited keeps its "finished successfully"
    then, but not its fragments' deltas, so the browser removes those fragments' places as stale,
    and the fragment run that follows writes into a place that is gone: "Bad delta path", and
    the page stops (on a loaded machine, after a click: the charts, the detail tabs and the
    status line's notice were lost). Here the queue is left whole in that one case; the fragment
    run's deltas then follow the full run's and redraw the same places. Installed once per
    process; a Streamlit whose queue has no such `clear` is left as it is."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from streamlit.runtime.forward_msg_queue import ForwardMsgQueue

    clear = ForwardMsgQueue.clear
    if getattr(clear, "keeps_full_runs", False):
        return
    if "fragment_ids_this_run" not in inspect.signature(clear).parameters:
        return  # another Streamlit: not the queue this guards
    finished = ForwardMsg.ScriptFinishedStatus.FINISHED_SUCCESSFULLY

    def guarded(
        self: ForwardMsgQueue,
        retain_lifecycle_msgs: bool = False,
        fragment_ids_this_run: list[str] | None = None,
    ) -> None:
        if (
            retain_lifecycle_msgs
            and fragment_ids_this_run is not None
            and any(
                m.WhichOneof("type") == "script_finished" and m.script_finished == finished
                for m in self._queue
            )
        ):
            # a new run's deltas must not be merged into the old run's (the browser would
            # count them to the full run, then clear them as stale after the fragment run)
            self._delta_index_map = {}
            return
        clear(self, retain_lifecycle_msgs, fragment_ids_this_run)

    guarded.keeps_full_runs = True  # type: ignore[attr-defined]
    ForwardMsgQueue.clear = guarded  # type: ignore[method-assign]
