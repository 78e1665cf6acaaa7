"""The sections the live, watched and recording pages share: the headline strip, the status
line, the paused banner and the detail tabs.

Every section has a fixed place on its page whatever it shows (an empty container when it has
nothing to say): the live charts' component must keep its position between runs, or Streamlit
mounts a new one, which starts with no steps.
"""

from __future__ import annotations

import streamlit as st

from app import aggregate, delays_view, panels, rerun, session
from app.client import EngineLink
from app.replay import ReplayLink

Link = EngineLink | ReplayLink
TITLE = "## :material/monitoring: stepscope"
TAGLINE = (
    "An LLM inference engine, step by step: which requests share each batch, where prompts are "
    "cut into chunks, how full the KV cache is, and when decoding stalls."
)
PAUSED = "Paused: the charts are frozen so you can zoom and hover. Switch Live back on."
WATCHED_DELAYS = (
    "A watched engine's steps name no request, so no request's delay can be named: what prompt "
    "work added to each step's decodes is shown with its charts above."
)


def header(caption: str = TAGLINE) -> None:
    st.markdown(TITLE)
    st.caption(caption)


def headline(link: Link) -> None:
    """The metric row over the steps in view, and what may be missing from the record."""
    snap = session.metrics_snapshot(link)
    panels.metrics_row(snap, causes=link.store)
    panels.delivery_notice(snap)


def runs_line() -> None:
    """The newest workloads and OpenAI posts this tab started, and how far each got."""
    for run in session.PRESET_RUNS.get()[-3:]:
        panels.run_line(run)
    for posted in session.OPENAI_SUBMITS.get()[-3:]:
        if not posted.done:
            st.caption(f":material/play_circle: sent to {posted.request.full_url}; waiting…")
        elif posted.error:
            st.error(f"{posted.request.full_url}: {posted.error}")
        else:
            st.caption(f":material/check_circle: {posted.request.full_url}: {posted.text}")


def notices_line() -> None:
    """The newest command outcome of this tab (a full run draws it; see rerun.show_notices_now)."""
    session.NOTICE_UNSHOWN.pop()  # shown here, in this run
    with st.container():
        for ok, text in session.UNSHOWN_TOASTS.pop():
            st.toast(text, icon=":material/check_circle:" if ok else ":material/error:")
        items = session.notices()
        if items:
            last = items[-1]
            (st.success if last.ok else st.error)(last.text)


def paused_banner() -> None:
    """Says the charts are frozen; its container is drawn either way (see the module's note)."""
    with st.container():
        if not session.is_live():
            st.info(PAUSED, icon=":material/pause_circle:")


def detail_views(link: Link, abort_note: str | None = None) -> None:
    """What the charts do not show, refreshed once a second while its tab is open: the
    tensor-parallel ranks (when steps carry them), output text, the KV page map, requests, and
    who delayed whom."""
    rerun.show_notices_now()  # an Abort clicked here reran only this fragment
    snap = session.view_snapshot(link, cap=panels.LATENCY_STEPS)
    panels.ranks_view(snap.steps, snap.engine)
    tabs = st.tabs(["Output text", "KV page map", "Requests", "Delays"], key="detail_tab",
                   on_change="rerun")  # fmt: skip
    if tabs[0].open:
        with tabs[0]:
            panels.outputs_view(session.requests_snapshot(link))
    if tabs[1].open:
        with tabs[1]:
            panels.page_map_view(link)
    if tabs[2].open:
        with tabs[2]:
            panels.requests_view(link, snap, abort_note)
    if tabs[3].open:
        with tabs[3]:
            watched = aggregate.any_aggregate(snap.steps)
            delays_view.delays_tab(link.store, WATCHED_DELAYS if watched else None)
