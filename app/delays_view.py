"""The Delays tab: each request's latency by cause, and for the whole run who delayed whom and
the total by cause (figures and rows from app.delays, over the store's fold).

Drawn only while its tab is open, once a second; the figures are rebuilt only when the store
changed since this tab last drew them (app.panels.chart).
"""

from __future__ import annotations

from typing import Protocol

import pandas as pd
import streamlit as st

from app import delays, panels
from instrumentation.blame import blame
from instrumentation.delay import Delay

NONE_YET = (
    "No request has a named delay yet. A request in flight is shown as far as the page saw it "
    "from its start; one the page joined late, once it ends (its end event names its delay)."
)


class DelaySource(Protocol):
    """The store (app.state.EventStore)."""

    @property
    def version(self) -> int: ...

    def delays(self) -> dict[int, Delay]: ...


def delays_tab(store: DelaySource, note: str | None = None) -> None:
    """Per request, its latency by cause; for the run, the total by cause and who delayed
    whom. `note`: why a source has none (a watched engine names no request)."""
    per = store.delays()
    if not per:
        st.info(note or NONE_YET)
        return
    run = blame(per)
    key = (store.version, len(per))
    st.caption(delays.CAPTION)
    panels.chart("delays_requests", key, lambda: delays.request_figure(per))
    if len(per) > delays.MAX_BARS:
        st.caption(f"The newest {delays.MAX_BARS} of {len(per)} requests; the run's figures "
                   "below count them all.")  # fmt: skip
    st.markdown("**The whole run**")
    st.caption(delays.RUN_CAPTION)
    left, right = st.columns([1.2, 1])
    with left:
        panels.chart("delays_run", key, lambda: delays.run_figure(run))
    with right:
        pairs = delays.pair_rows(run, per)
        if pairs:
            st.markdown("Who delayed whom")
            st.dataframe(
                pd.DataFrame(pairs), hide_index=True, height=min(420, 40 + 35 * len(pairs))
            )
        else:
            st.caption("No request's work delayed another.")
        culprits = delays.culprit_rows(run)
        if culprits:
            st.markdown("What each cost the others")
            st.dataframe(pd.DataFrame(culprits), hide_index=True,
                         height=min(300, 40 + 35 * len(culprits)))  # fmt: skip
