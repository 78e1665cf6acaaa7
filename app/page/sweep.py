"""The sweep page: one workload under each (policy, budget), as a trade-off plot of TTFT p50
against the tail you pick (app/sweep_view.py reads the folder `python -m bench.sweep` wrote).
A click on a point opens that run's recording; closing it comes back here."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from app import opener, panels
from app.page import common
from app.sweep_view import SweepFolder


def _row(row: Any) -> dict[str, Any]:
    return {
        name: round(v, 4) if isinstance(v := getattr(row, name), float) else v
        for name in row.__slots__
    }


def render(sweep: SweepFolder) -> None:
    common.header(f"{sweep.title}: the chapter's trade-off, one point per run.")
    panels.sweep_chart(sweep, on_select=opener.on_sweep_select)
    st.dataframe(pd.DataFrame([_row(r) for r in sweep.rows]), hide_index=True)
