"""The charts' colours and names, defined once here and sent to the browser (`component.style`).

A request keeps its colour in every chart and table; red means a stall everywhere on the page.
"""

from __future__ import annotations

STALL_RED = "#d62728"
# No reds or pinks: red means a stall everywhere on the page. No greys either: grey means
# waiting (WAIT_GREY) or wasted work (WASTED_GREY).
PALETTE = (
    "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#8c564b",
    "#bcbd22", "#393b79", "#637939", "#e7ba52", "#6b6ecf", "#1b9e77",
)  # fmt: skip
PHASE_COLORS = {"prefill": "#dce9f7", "decode": "#e2f2dc", "mixed": "#efe4f5"}
KV_COLORS = {"used": "#4c78a8", "cached": "#9ecae9", "free": "#ececec"}
WAIT_GREY = "#c7c7c7"
WASTED_GREY = "#b0b0b0"  # work a step did for a request that ended while it ran
X_TITLES = {"step": "engine step", "time": "engine time (s)"}
POLICY_COLORS = {"prefill_first": "#d62728", "mixed": "#1f77b4"}


def request_color(uid: int) -> str:
    """Each request keeps this colour in every chart."""
    return PALETTE[uid % len(PALETTE)]
