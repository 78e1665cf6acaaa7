"""stepscope's dashboard: `streamlit run app/main.py`, then watch an engine schedule, step by step.

This file only picks the page; each page is one module of app/page/ that draws it whole:

| what the page was given | page |
|---|---|
| a fleet recording (`--fleet-trace DIR`, or the sidebar) | `fleet_recording` |
| several engines (`--fleet FILE`, or a comma-separated `STEPSCOPE_URL`) | `fleet` |
| a recording and a second one to compare it with | `comparison` |
| a recording (`--trace FILE`, or the sidebar) | `recording` |
| a sweep folder (the sidebar), until one of its runs is opened | `sweep` |
| an engine that turns out to be a watched SGLang or vLLM | `watched` |
| a stepscope engine (started here if nothing answers at a local URL) | `live` |

The page is a thin protocol client (docs/protocol.md): one background connection per app process
feeds every browser tab; this tab's state is app/session.py's, and Streamlit's rerun workarounds
are app/rerun.py's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# `streamlit run app/main.py` puts app/ on sys.path, not the project root that holds `app`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from app import opener, rerun, session, sidebar  # noqa: E402
from app.client import valid_url  # noqa: E402
from app.page import comparison, fleet, fleet_recording, live, recording, sweep, watched  # noqa: E402


def main() -> None:
    st.set_page_config(page_title="stepscope", page_icon="🔭", layout="wide")
    rerun.keep_full_runs_whole()
    session.settle_held()  # before any fragment asks whether the page is outdated
    with rerun.full_run():
        page()


def page() -> None:
    """Pick the page from what this tab was given, and let it draw itself."""
    target = live.engine_target()
    if session.URL.get() != target.url:  # another tab may have changed the process's URL
        session.URL.set(target.url)
    opened = fleet_recording.sidebar()
    if opened.folder is not None:
        fleet_recording.render(opened)
        return
    spec, problem = fleet.spec_for(target.url, sys.argv[1:], os.environ)
    if spec is not None or problem is not None:
        sidebar.engine_section(target)
        fleet.render(spec, problem)
        return
    opener.sidebar()
    source, other = session.REPLAY_SOURCE.get(), session.REPLAY_COMPARE.get()
    folder = session.REPLAY_SWEEP.get()
    if source is not None and other is not None:
        comparison.render(source, other)
    elif source is not None:
        recording.render(source)
    elif folder is not None:
        sweep.render(folder)
    elif (problem := valid_url(target.url)) is not None:
        sidebar.engine_section(target)
        st.error(problem)
    else:
        link = live.engine_link(target.url)
        rerun.await_hello([link])
        mode = live.mode_now(link)
        session.PAGE_MODE.set(mode)
        if mode.external:
            watched.render(link, target, mode)
        else:
            live.render(link, target, mode)


main()
