"""stepscope's dashboard: `streamlit run app/main.py`, then watch an engine schedule, step by step.

The page is a thin protocol client (docs/protocol.md): one background connection per app process
(`engine_link`, a cached resource) feeds every browser tab. The charts are one custom component
(app/live) that draws in the browser and receives only the steps it does not have yet, as often
as the browser asks (up to 5 times a second); the rest of the page (metrics, tables, the KV page
map) refreshes once a second. If nothing answers at a local URL, the app starts
`python -m engine.server --device auto`.

This tab's state is app/session.py's (every session-state key, typed). What only a full
run draws (the scheduling controls, the status line) is redrawn without a click: the fragments
that refresh on their own ask for one full run when it changed (`page_outdated`).

Environment: STEPSCOPE_URL (default ws://127.0.0.1:8765), STEPSCOPE_MODEL (default smollm2),
STEPSCOPE_AUTOSTART (0 turns the auto-start off), STEPSCOPE_ENGINE_ARGS (extra server flags).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path

# `streamlit run app/main.py` puts app/ on sys.path, not the project root that holds `app`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from app import controls, external, fleet_ui, panels, replay_ui, session, sidebar, workloads  # noqa: E402
from app.client import EngineLink, valid_url  # noqa: E402
from app.fleet_replay_ui import open_fleet_recording, render_fleet_recording  # noqa: E402
from app.kvmap import PageMapStore  # noqa: E402
from app.launcher import Launcher, engine_argv, local_port, should_autostart  # noqa: E402
from app.live.component import LIVE_EVERY_S  # noqa: E402
from app.replay import ReplayLink  # noqa: E402

DEFAULT_URL = os.environ.get("STEPSCOPE_URL", "ws://127.0.0.1:8765")
MODEL = os.environ.get("STEPSCOPE_MODEL", "smollm2")
AUTOSTART = os.environ.get("STEPSCOPE_AUTOSTART", "1") != "0"
ENGINE_ARGS = tuple(shlex.split(os.environ.get("STEPSCOPE_ENGINE_ARGS", "")))
REFRESH_S = sidebar.REFRESH_S
# While the page waits on the engine (controls not drawn yet, a prompt held), it looks this often
# whether the full page must be redrawn; once whole, this watch is not drawn at all.
WATCH_S = 0.25
# An external engine's OpenAI endpoint: `streamlit run app/main.py -- --openai-url URL` or env.
OPENAI_URL = external.openai_url_from(sys.argv[1:], os.environ)


@st.cache_resource(show_spinner=False)
def engine_target() -> sidebar.Target:
    """The URL every tab watches: one per process, like the connection it names."""
    return sidebar.Target(DEFAULT_URL)


def _close_link(link: EngineLink) -> None:
    link.close()


@st.cache_resource(max_entries=1, on_release=_close_link, show_spinner=False)
def engine_link(url: str) -> EngineLink:
    """The process's one connection; changing the URL releases (closes) the previous one."""
    return EngineLink(url, store=PageMapStore()).start()


def _stop_launcher(launcher: Launcher) -> None:
    launcher.stop()


@st.cache_resource(on_release=_stop_launcher, show_spinner=False)
def engine_launcher() -> Launcher:
    return Launcher()


def _argv(url: str) -> list[str]:
    return engine_argv(local_port(url) or 8765, MODEL, ENGINE_ARGS)


def _restart_engine(launcher: Launcher, url: str) -> None:
    launcher.restart(_argv(url))


def page_mode(link: EngineLink | ReplayLink) -> external.ExternalMode:
    """Whether the engine is external (a watch), or a recording stands in for it (a replay),
    and what the page may send it."""
    delta = link.store.delta(session.MODE_CURSOR.get(), metrics=False)
    session.MODE_CURSOR.set(delta.cursor)
    mode = external.external_mode(delta.engine, OPENAI_URL)
    if isinstance(link, ReplayLink):
        mode = dataclasses.replace(mode, replaying=link.source.recording.name)
    return mode


def page_outdated(link: EngineLink) -> bool:
    """What the full page draws has changed since it last ran, and no fragment draws it: the
    engine turned out external (or not), its config arrived (the scheduling controls), or a
    held prompt reached it (its notice). The fragments that refresh on their own ask for one
    full run then (when `session.may_ask_full_run`), so the page is whole without a click."""
    if not session.may_ask_full_run():
        return False
    return (
        page_mode(link) != session.PAGE_MODE.get()
        or session.controls_outdated(link)
        or session.held_outdated()
    )


def redraw_when_outdated(link: EngineLink) -> None:
    """Draws nothing: asks for the full page once what it shows is outdated (the first minute:
    the engine's config arrived, a held prompt was sent)."""
    if page_outdated(link):
        st.rerun(scope="app")


# ---- main area --------------------------------------------------------------------------------


def connection_panel(link: EngineLink, launcher: Launcher) -> None:
    """Loading progress, a lost engine, or a dead one, said plainly, with a way out."""
    url = link.url
    status = link.status()
    if page_outdated(link):
        st.rerun(scope="app")  # the engine came up, or turned out external: redraw the controls
    proc = launcher.process
    if should_autostart(
        url, status.ever_connected, status.failed_attempts, AUTOSTART, proc is not None
    ):
        proc = launcher.start(_argv(url))
    if status.state == "connected":
        return
    if proc is not None and proc.state == "starting":
        progress = proc.progress
        st.info(f"Starting the engine: `{shlex.join(proc.argv[1:])}` (pid {proc.pid}).")
        if progress is not None:
            st.progress(progress.fraction, text=f"{progress.label}: {progress.fraction:.0%}")
        st.code("\n".join(proc.tail(10)) or "(waiting for its first output)", language="text")
    elif proc is not None and proc.state == "ready":
        st.info(f"The engine is up at {proc.ready_url}; connecting…")
    elif proc is not None and proc.state == "exited":
        st.error(f"The engine process exited with code {proc.returncode}. Its last output:")
        st.code("\n".join(proc.tail(12)) or "(no output)", language="text")
        st.button(
            "Restart the engine",
            type="primary",
            on_click=_restart_engine,
            args=(launcher, url),
            key="restart-engine",
        )
    elif status.state == "connecting":
        st.info(f"Connecting to {url}…")
    else:
        lost = "Lost the engine" if status.ever_connected else "Nothing answers"
        st.warning(f"{lost} at {url}: {status.error} Retrying every second.")
        if local_port(url) is not None:
            st.button(
                f"Start an engine here ({MODEL})",
                on_click=lambda: launcher.start(_argv(url)),
                key="start-engine",
            )


def status_strip(link: EngineLink) -> None:
    snap = session.metrics_snapshot(link)
    panels.metrics_row(snap)
    panels.delivery_notice(snap)
    for run in session.PRESET_RUNS.get()[-3:]:
        panels.run_line(run)
    for posted in session.OPENAI_SUBMITS.get()[-3:]:
        if not posted.done:
            st.caption(f":material/play_circle: sent to {posted.request.full_url}; waiting…")
        elif posted.error:
            st.error(f"{posted.request.full_url}: {posted.error}")
        else:
            st.caption(f":material/check_circle: {posted.request.full_url}: {posted.text[-200:]}")


def openai_submit(mode: external.ExternalMode, command: dict, copies: int) -> None:
    """An external engine with an OpenAI endpoint: post the prompt there (a thread per copy)."""
    assert mode.openai_url is not None
    posts = session.OPENAI_SUBMITS.setdefault()
    for _ in range(copies):
        request = external.openai_request(
            mode.openai_url,
            str(command["prompt"]),
            int(command["max_tokens"]),
            float(command.get("temperature") or 0.0),
            bool(command.get("chat")),
            mode.model,
        )
        posts.append(external.OpenAISubmit(request).start())
    del posts[:-20]
    session.notify(True, f"sent {copies} prompt(s) to {mode.openai_url} (OpenAI API)")


def prompt_form(link: EngineLink, mode: external.ExternalMode) -> None:
    off = not mode.can_submit
    if off:
        st.info("Submitting prompts: " + mode.disabled_note(), icon=":material/block:")
        if mode.replaying is None:
            return
        # a replay keeps the form in view, disabled, so the page looks as it did live
    if mode.external:
        st.caption(
            f"Prompts go to the engine's OpenAI endpoint {mode.openai_url} over HTTP; their steps "
            "show here as the engine reports them."
        )
    with st.form("prompt", border=True):
        text = st.text_area(
            "Prompt",
            key=session.PROMPT_TEXT.key,
            height=80,
            placeholder="Type a prompt, or pick a workload in the sidebar…",
            disabled=off,
        )
        c = st.columns([1, 1, 1, 1, 1, 1.2])
        max_tokens = c[0].number_input(
            "max_tokens", min_value=1, value=64, key=session.MAX_TOKENS.key, disabled=off
        )
        temperature = c[1].number_input(
            "temperature",
            min_value=0.0,
            value=0.0,
            step=0.1,
            key=session.TEMPERATURE.key,
            help="0: greedy.",
            disabled=off,
        )
        copies = c[2].number_input(
            "copies",
            min_value=1,
            max_value=controls.MAX_COPIES,
            value=1,
            key=session.COPIES.key,
            disabled=off,
        )
        chat = c[3].toggle("chat template", value=True, key=session.CHAT.key, disabled=off)
        ignore_eos = c[4].toggle(
            "ignore EOS", value=False, key=session.IGNORE_EOS.key, disabled=off
        )
        submitted = c[5].form_submit_button("Submit", type="primary", width="stretch", disabled=off)
    if not submitted or off:
        return
    try:
        command = controls.submit(text or "", int(max_tokens), float(temperature), chat, ignore_eos)
        commands = controls.submit_copies(command, int(copies))
    except ValueError as exc:
        session.notify(False, str(exc))
        return
    if mode.external:
        openai_submit(mode, command, int(copies))
        return
    if link.status().state != "connected":
        # The first minute: the engine is still loading. Hold the prompt and send it the moment
        # the engine is up, rather than refusing it.
        run = workloads.PresetRun(workloads.prompt_preset(commands)).start(link)
        session.hold(run, "The engine is starting: your prompt is held and sent once it is up.")
        return
    session.submit_now(link, commands)


def notices_line() -> None:
    session.NOTICE_UNSHOWN.pop()  # shown here, in this run
    for ok, text in session.UNSHOWN_TOASTS.pop():
        st.toast(text, icon=":material/check_circle:" if ok else ":material/error:")
    items = session.notices()
    if not items:
        return
    last = items[-1]
    (st.success if last.ok else st.error)(last.text)


def external_area(link: EngineLink) -> None:
    """An external engine's aggregate steps (the live charts draw per-request items)."""
    panels.external_charts(session.view_snapshot(link))


def ranks_area(link: EngineLink) -> None:
    """Each tensor-parallel rank's step time, when the engine's steps carry ranks."""
    snap = session.view_snapshot(link, cap=panels.LATENCY_STEPS)
    panels.ranks_view(snap.steps, snap.engine)


def live_area(link: EngineLink) -> None:
    """The live charts: only the component's own pulls rerun this fragment."""
    # Until the engine first answers, the loading progress above is the page: the charts stay
    # hidden, but mounted, so their pulls find the engine the moment it is up.
    panels.live_charts(link, hidden=not link.status().ever_connected)


def top_panels(link: EngineLink, launcher: Launcher) -> None:
    """Above the prompt form, once a second: the metrics strip, then the engine's loading
    progress or a lost engine (which keep updating while the charts are paused)."""
    status_strip(link)
    connection_panel(link, launcher)


def lower_panels(link: EngineLink, abort_note: str | None = None) -> None:
    """Below the charts: the tensor-parallel ranks (when steps carry them) and the detail tabs."""
    ranks_area(link)
    detail_views(link, abort_note)


def detail_views(link: EngineLink, abort_note: str | None = None) -> None:
    """What the charts do not show, refreshed once a second while its tab is open."""
    session.show_notices_now()  # an Abort clicked here reran only this fragment
    tabs = st.tabs(["Output text", "KV page map", "Requests"], key="detail_tab", on_change="rerun")
    if tabs[0].open:
        with tabs[0]:
            panels.outputs_view(session.requests_snapshot(link))
    if tabs[1].open:
        with tabs[1]:
            panels.page_map_view(link)
    if tabs[2].open:
        with tabs[2]:
            panels.requests_view(
                link, session.view_snapshot(link, cap=panels.LATENCY_STEPS), abort_note
            )


def main() -> None:
    st.set_page_config(page_title="stepscope", page_icon="🔭", layout="wide")
    session.settle_held()  # before any fragment asks whether the page is outdated
    session.FULL_RUN.set(True)
    try:
        page()
    finally:  # also when a rerun or an error ends this run early
        session.FULL_RUN.set(False)
        session.FULL_RUN_END.set(time.monotonic())
        session.TICKS_SINCE_FULL_RUN.set(0)


def page() -> None:
    """The whole page, drawn by a full run (the fragments then refresh their parts)."""
    target = engine_target()
    # Another tab may have changed the process's URL: show it here too.
    if session.URL.get() != target.url:
        session.URL.set(target.url)
    fleet_trace = open_fleet_recording()  # a fleet recording stands in for the fleet
    if fleet_trace.folder is not None:
        render_fleet_recording(fleet_trace)
        return
    fleet, fleet_problem = fleet_ui.spec_for(target.url, sys.argv[1:], os.environ)
    if fleet is not None or fleet_problem is not None:  # several engines: the fleet page
        sidebar.render(None, target)
        if fleet is None:
            st.error(fleet_problem)
            return
        fleet_ui.render(fleet)
        return
    problem = valid_url(target.url)
    replay = replay_ui.sidebar()  # an open recording stands in for the engine (app/replay_ui.py)
    link = replay or (None if problem else engine_link(target.url))
    if link is not None and replay is None:
        session.await_hello([link])
    launcher = engine_launcher()
    mode = page_mode(link) if link is not None else external.ExternalMode(False)
    session.PAGE_MODE.set(mode)
    sidebar.render(link, target, mode, page_outdated)

    st.markdown("## :material/monitoring: stepscope")
    st.caption(
        "An LLM inference engine, step by step: which requests share each batch, where prompts "
        "are cut into chunks, how full the KV cache is, and when decoding stalls."
    )
    replay_ui.main_controls()
    if link is None:
        st.error(problem or "No engine URL.")
        return
    every = REFRESH_S if session.is_live() else None
    if not session.is_live():
        st.info("Paused: the charts are frozen so you can zoom and hover. Switch Live back on.")
    # Few fragments, each doing several views' work: every fragment run is a turn of the one
    # script thread, which the live charts' pulls wait behind (issue 13: several updates a second)
    st.fragment(top_panels, run_every=REFRESH_S)(link, launcher)
    if session.awaiting_engine():
        st.fragment(redraw_when_outdated, run_every=WATCH_S)(link)
    prompt_form(link, mode)
    notices_line()
    replay_ui.panels()
    abort_note = None if mode.commands else "Abort: " + mode.disabled_note()
    if mode.external:
        st.fragment(external_area, run_every=every)(link)
    else:
        st.fragment(live_area, run_every=LIVE_EVERY_S if session.is_live() else None)(link)
    st.fragment(lower_panels, run_every=every)(link, abort_note)


main()
