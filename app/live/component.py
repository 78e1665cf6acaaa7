"""The live charts and the KV page map as one `st.components.v2` component, drawn in place.

Streamlit re-sends a v2 component's inline JavaScript with every update, so the inline part is a
tiny loader (static/loader.js); plotly.js (from the installed `plotly` package, the browser has
no internet) and the charts' code (static/live.js) are served once as static files, through two
v1 component paths that exist only for that.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plotly
import streamlit.components.v1 as v1
import streamlit.components.v2 as v2

from app import figures, session
from app.live.feed import LiveFeed, ViewOptions

STATIC = Path(__file__).resolve().parent / "static"
PLOTLY_DIR = Path(plotly.__file__).resolve().parent / "package_data"
_assets = v1.declare_component("assets", path=str(STATIC))
_plotlyjs = v1.declare_component("plotlyjs", path=str(PLOTLY_DIR))


def _minified(js: str) -> str:
    """The loader without its comments and indentation: Streamlit re-sends it with every update
    (measured: 1.1 KB of each 2.7 KB update before, a third of that after)."""
    lines = (line.strip() for line in js.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("//"))


_component = v2.component(
    "stepscope.live", js=_minified((STATIC / "loader.js").read_text()), isolate_styles=False
)

# The browser asks for the next batch at most this often (5 a second), and waits a little longer
# when the last answer had nothing new. The charts' fragment also reruns on its own every
# LIVE_EVERY_S, a fallback for a pull Streamlit answered late or not at all: an answer to a pull
# starts exactly where the browser is, while a timer's payload must repeat recent batches
# (OVERLAP), so the timer is slow (at 0.25 s it sent 3x the bytes and took script-thread turns
# from the pulls).
PULL_MS = 200
IDLE_MS = 300
LIVE_EVERY_S = 1.0
OVERLAP = 3  # batches each payload covers
# Level of detail: per-request segments while each step in view is at least this many pixels
# wide and there are at most this many segments; per-step totals past that.
PX_PER_STEP = 3
MAX_SEGMENTS = 4000
MAX_LANES = 40


def _assets_urls() -> dict[str, str]:
    version = int((STATIC / "live.js").stat().st_mtime)  # a changed file is fetched again
    return {
        "plotly": f"component/{_plotlyjs.name}/plotly.min.js",
        "live": f"component/{_assets.name}/live.js?v={version}",
    }


def style() -> dict[str, Any]:
    """Colours and limits, defined once in Python (app.figures) and used by the browser."""
    return {
        "palette": list(figures.PALETTE),
        "phases": list(figures.PHASE_COLORS),
        "phase_colors": figures.PHASE_COLORS,
        "stall": figures.STALL_RED,
        "wait": figures.WAIT_GREY,
        "wasted": figures.WASTED_GREY,
        "kv": figures.KV_COLORS,
        "x_titles": figures.X_TITLES,
        "lod": {"px_per_step": PX_PER_STEP, "max_segments": MAX_SEGMENTS},
        "max_lanes": MAX_LANES,
        "pull_ms": PULL_MS,
        "idle_ms": IDLE_MS,
    }


def _html(markdown: str) -> str:
    """The few markdown marks the captions use, as HTML."""
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", markdown)
    text = re.sub(r"\*(.+?)\*", r"<i>\1</i>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def live_charts(
    store: Any,
    key: str,
    opts: ViewOptions,
    captions: Callable[[str | None], dict[str, str]],
    hidden: bool = False,
) -> LiveFeed:
    """Mount (or update) the live charts; call inside a fragment that only their pulls rerun.

    `captions(policy)` gives each view's caption; they are sent again only when the policy
    changed or the browser may not have them (a reset or a new view)."""
    feeds = session.LIVE_FEEDS.setdefault()
    feed = feeds.setdefault(key, LiveFeed())
    pulled = (session.component_value(key) or {}).get("pull") or {}
    # A new pull says what the browser holds. Otherwise (the fragment's own timer, a full
    # rerun) assume it drew what was sent last: a browser that did not ignores the batch
    # (its base is not what it holds), and its next pull says where it really is.
    # Streamlit may also skip a payload on its way to the browser (only the newest render of a
    # component reaches it), so each payload repeats the previous OVERLAP - 1 batches; the
    # browser keeps only the steps it does not hold.
    seen = session.LIVE_SEEN.setdefault()
    last_n, sent = seen.get(key, (None, []))
    if pulled.get("n") != last_n:
        have = pulled.get("have")
    else:
        have = sent[-OVERLAP] if len(sent) >= OVERLAP else (sent[0] if sent else None)
    data = feed.payload(store, have, opts)
    if data.get("reset"):
        sent = []
    if not sent or sent[-1] != data.get("id"):
        sent = [*sent, data.get("id")][-OVERLAP:]
    seen[key] = (pulled.get("n"), sent)
    data["answer"] = pulled.get("n")  # which pull this answers
    if hidden:
        data["hidden"] = True
    sent = session.LIVE_SENT_POLICY.setdefault()
    policy = (data.pop("config", None) or {}).get("policy", sent.get(key))
    fresh = data.get("reset") or pulled.get("have") is None  # the browser may have nothing
    if fresh:
        data["assets"] = _assets_urls()
    if fresh or sent.get(key) != policy:
        sent[key] = policy
        data["style"] = style()
        data["captions"] = {k: _html(v) for k, v in captions(policy).items()}
    _component(key=key, data=data, on_pull_change=_pulled, height="content")
    return feed


def kv_page_map(key: str, page_map: dict[str, Any] | None, message: str = "") -> None:
    """Draw the engine's `kv_map` reply, one cell per page."""
    data = {"mode": "kvmap", "map": page_map, "message": message, "assets": _assets_urls()}
    data["style"] = style()
    _component(key=key, data=data, height="content")


def _pulled() -> None:
    """The browser drew a batch and wants the next: rerunning the fragment is the answer."""
