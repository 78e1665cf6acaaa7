"""The comparison page: two recordings, A above B, drawn whole on aligned axes (zooming one
zooms both), with a table of their headline figures and the differences (app/compare.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from app import compare, opener, panels, session, sidebar
from app.page import common
from app.replay import Recording, ReplayLink, ReplaySource


def _fmt(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def render(source: ReplaySource, other: Recording) -> None:
    sidebar.view_section(ReplayLink(source))
    common.header(f"Two recordings compared: A `{source.recording.name}` and B `{other.name}`.")
    st.markdown("### Compare")
    a, b = compare.side(source.recording), compare.side(other)
    rows = [{k: _fmt(v) for k, v in r.items()} for r in compare.table(a, b)]
    st.dataframe(pd.DataFrame(rows), hide_index=True, key="compare_table")
    left, right = st.columns(2)
    left.button(f"Replay A ({source.recording.name}) alone", key="compare_close_main",
                on_click=session.REPLAY_COMPARE.pop)  # fmt: skip
    right.button(f"Open B ({other.name}) in the page", key="compare_open_b",
                 on_click=_replay_b)  # fmt: skip
    panels.compare_charts(a, b, xmode=session.XMODE.get())


def _replay_b() -> None:
    """B becomes the replayed recording, and the comparison closes."""
    opener.open_compared()
    session.REPLAY_COMPARE.pop()
