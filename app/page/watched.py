"""The watched page: a real SGLang or vLLM server, read from its logs, forward-pass metrics or
KV events (`python -m instrumentation.watch`, docs/watch.md).

Those sources carry counts, not request ids: the page draws batch composition, KV usage, queue
and throughput per step, and disables what the engine cannot take (the scheduling controls,
workloads, Abort). With an OpenAI endpoint (`--openai-url`), Submit posts prompts there.
"""

from __future__ import annotations

import streamlit as st

from app import external, panels, prompt, rerun, session, sidebar
from app.client import EngineLink
from app.page import common, live


def _top(link: EngineLink) -> None:
    common.headline(link)
    common.runs_line()
    live.connection_panel(link, live.engine_launcher())


def _charts(link: EngineLink) -> None:
    """The engine's aggregate steps (a watch has no per-request lanes)."""
    panels.external_charts(session.view_snapshot(link))


def render(link: EngineLink, target: sidebar.Target, mode: external.ExternalMode) -> None:
    outdated = lambda lk: rerun.page_outdated(lk, live.mode_now)  # noqa: E731
    sidebar.engine_section(target, link, mode, outdated)
    sidebar.scheduling_section(link, mode)
    sidebar.workloads_section(link, mode)
    sidebar.view_section(link)
    sidebar.session_section(link)
    common.header()
    every = sidebar.REFRESH_S if session.is_live() else None
    st.fragment(_top, run_every=sidebar.REFRESH_S)(link)
    prompt.form(link, mode)
    common.notices_line()
    common.paused_banner()
    st.fragment(_charts, run_every=every)(link)
    abort_note = None if mode.commands else "Abort: " + mode.disabled_note()
    st.fragment(common.detail_views, run_every=every)(link, abort_note)
