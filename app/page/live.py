"""The live page: a stepscope engine, watched as it runs, with every control.

From the top: the headline (the metric row over the steps in view), the engine's loading
progress or why it is gone, the prompt form, the status line, the live charts, then the detail
tabs. If nothing answers at a local URL, the page starts `python -m engine.server --device auto`
(app/launcher.py) and shows it loading; a prompt or workload sent meanwhile is held and sent the
moment the engine is up.
"""

from __future__ import annotations

import os
import shlex
import sys

import streamlit as st

from app import external, panels, prompt, rerun, session, sidebar
from app import launcher as launching
from app.client import EngineLink
from app.kvmap import PageMapStore
from app.launcher import Launcher, local_port, port_taken, should_autostart
from app.live.component import LIVE_EVERY_S
from app.page import common

REFRESH_S = sidebar.REFRESH_S
# While the page waits on the engine (controls not drawn yet, a prompt held), it looks this often
# whether the full page must be redrawn; once whole, this watch does nothing.
WATCH_S = 0.25


# The environment is read when asked, not at import: this module outlives a script run.
def _model() -> str:
    return os.environ.get("STEPSCOPE_MODEL", "smollm2")


def _autostart() -> bool:
    return os.environ.get("STEPSCOPE_AUTOSTART", "1") != "0"


def _openai_url() -> str | None:
    """A watched engine's OpenAI endpoint: `streamlit run app/main.py -- --openai-url URL`."""
    return external.openai_url_from(sys.argv[1:], os.environ)


@st.cache_resource(show_spinner=False)
def engine_target() -> sidebar.Target:
    """The URL every tab watches: one per process, like the connection it names."""
    return sidebar.Target(os.environ.get("STEPSCOPE_URL", "ws://127.0.0.1:8765"))


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
    extra = tuple(shlex.split(os.environ.get("STEPSCOPE_ENGINE_ARGS", "")))
    return launching.engine_argv(local_port(url) or 8765, _model(), extra)


def _restart_engine(launcher: Launcher, url: str) -> None:
    launcher.restart(_argv(url))


def mode_now(link: EngineLink) -> external.ExternalMode:
    """Whether the engine is a watched SGLang or vLLM, and what the page may send it."""
    delta = link.store.delta(session.MODE_CURSOR.get(), metrics=False)
    session.MODE_CURSOR.set(delta.cursor)
    return external.external_mode(delta.engine, _openai_url())


def connection_panel(link: EngineLink, launcher: Launcher) -> None:
    """Loading progress, a lost engine, or a dead one, said plainly, with a way out."""
    url = link.url
    status = link.status()
    rerun.redraw_when_outdated(link, mode_now)  # the engine came up, or turned out watched
    proc = launcher.process
    if should_autostart(
        url, status.ever_connected, status.failed_attempts, _autostart(), proc is not None
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
        tail = proc.tail(12)
        taken = port_taken(tail)
        st.error(taken or f"The engine process exited with code {proc.returncode}. Its output:")
        st.code("\n".join(tail) or "(no output)", language="text")
        st.button("Restart the engine", type="primary", on_click=_restart_engine,
                  args=(launcher, url), key="restart-engine")  # fmt: skip
    elif status.state == "connecting":
        st.info(f"Connecting to {url}…")
    else:
        lost = "Lost the engine" if status.ever_connected else "Nothing answers"
        st.warning(f"{lost} at {url}: {status.error} Retrying every second.")
        if local_port(url) is not None:
            st.button(f"Start an engine here ({_model()})", key="start-engine",
                      on_click=lambda: launcher.start(_argv(url)))  # fmt: skip


def _top(link: EngineLink, launcher: Launcher) -> None:
    """Once a second: the headline, the runs, and the engine's loading progress or loss (which
    keep updating while the charts are paused)."""
    common.headline(link)
    common.runs_line()
    connection_panel(link, launcher)


def _charts(link: EngineLink) -> None:
    """The live charts: only the component's own pulls rerun this fragment. Until the engine
    first answers they stay hidden but mounted, so their pulls find it the moment it is up."""
    panels.live_charts(link, hidden=not link.status().ever_connected)


def _first_minute(link: EngineLink) -> None:
    """While the page waits on the engine: redraw it whole once the engine is up."""
    rerun.redraw_when_outdated(link, mode_now)


def render(link: EngineLink, target: sidebar.Target, mode: external.ExternalMode) -> None:
    launcher = engine_launcher()
    sidebar.engine_section(target, link, mode, lambda lk: rerun.page_outdated(lk, mode_now))
    sidebar.scheduling_section(link, mode)
    sidebar.workloads_section(link, mode)
    sidebar.view_section(link)
    sidebar.session_section(link)
    common.header()
    live = session.is_live()
    st.fragment(_top, run_every=REFRESH_S)(link, launcher)
    with st.container():  # a fixed place, drawn or not (see app/page/common.py)
        if rerun.awaiting_engine():  # a fragment run is a script-thread turn: only when needed
            st.fragment(_first_minute, run_every=WATCH_S)(link)
    prompt.form(link, mode)
    common.notices_line()
    common.paused_banner()
    st.fragment(_charts, run_every=LIVE_EVERY_S if live else None)(link)
    st.fragment(common.detail_views, run_every=REFRESH_S if live else None)(link)
