"""Every chart of the page as one `st.components.v2` component, drawn in the browser: the live
charts (live and replay), a recording drawn whole (compare), the sweep's trade-off plot and the
KV page map.

Streamlit re-sends a v2 component's inline JavaScript with every update, so the inline part is a
tiny loader (static/loader.js); plotly.js (from the installed `plotly` package, the browser has
no internet) and the charts' code (static/*.js, one file per chart, see SCRIPTS) are served once
as static files, through two v1 component paths that exist only for that.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plotly
import streamlit.components.v1 as v1
import streamlit.components.v2 as v2

from app import session
from app.live import encode
from app.live import style as colors
from app.live.feed import LiveFeed, Recorded, ViewOptions

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

# The charts' files, in load order: data.js first (the others read it), view.js last.
SCRIPTS = ("data.js", "timeline.js", "kv.js", "progress.js", "pagemap.js", "sweep.js", "view.js")
# The browser asks for the next batch at most this often (11 a second: a 100 ms period drew
# 9.4-9.9 updates/s for a 200-steps/s engine, the timer firing late behind a draw). A pull that
# finds nothing new is held on the server until the engine's next step lands (at most HOLD_S),
# so a step is drawn as soon as it arrives rather than at the next poll: with polling, a page
# whose pulls are out of phase with the engine's steps drew 1.9 updates/s against 3.4 steps/s.
# After IDLE_AFTER answers in a row with nothing new (an idle engine), the browser waits IDLE_MS
# before asking again: each answer costs the browser a Streamlit rerun's redraw (an idle page
# took 0.41 of a CPU core in Chromium, 0.33 with the wait), and a step after a pause is drawn
# at most IDLE_MS late. The charts' fragment also reruns on its own every LIVE_EVERY_S, a
# fallback for a pull Streamlit answered late or not at all: an answer to a pull starts exactly
# where the browser is, while a timer's payload must repeat recent batches (OVERLAP), so the
# timer is slow (at 0.25 s it sent 3x the bytes and took script-thread turns from the pulls).
PULL_MS = 90
IDLE_AFTER = 3
IDLE_MS = 700
HOLD_S = 0.3  # bounds how long a click waits behind a held pull, too
LIVE_EVERY_S = 1.0
OVERLAP = 3  # batches each payload covers
# Level of detail: per-request segments while each step in view is at least this many pixels
# wide and there are at most this many segments; per-step totals past that. Plotly takes ~28 ms
# per 1,000 bars a draw (2,600 segments: 70 ms, and a 7-steps/s engine's page fell to 0.6 of
# its steps; at 2,000: 0.98-1.0).
PX_PER_STEP = 3
MAX_SEGMENTS = 2000
MAX_LANES = encode.MAX_LANES


def _assets_urls() -> dict[str, Any]:
    def url(name: str) -> str:
        version = int((STATIC / name).stat().st_mtime)  # a changed file is fetched again
        return f"component/{_assets.name}/{name}?v={version}"

    return {
        "plotly": f"component/{_plotlyjs.name}/plotly.min.js",
        "scripts": [url(name) for name in SCRIPTS],
    }


def style() -> dict[str, Any]:
    """Colours and limits, defined once in Python (app.live.style) and used by the browser."""
    return {
        "palette": list(colors.PALETTE),
        "phases": list(colors.PHASE_COLORS),
        "phase_colors": colors.PHASE_COLORS,
        "stall": colors.STALL_RED,
        "wait": colors.WAIT_GREY,
        "wasted": colors.WASTED_GREY,
        "kv": colors.KV_COLORS,
        "policy_colors": colors.POLICY_COLORS,
        "x_titles": colors.X_TITLES,
        "lod": {"px_per_step": PX_PER_STEP, "max_segments": MAX_SEGMENTS},
        "max_lanes": MAX_LANES,
        "pull_ms": PULL_MS,
        "idle_ms": IDLE_MS,
        "idle_after": IDLE_AFTER,
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
    # A pull is told by its view (`m`: a view mounted afresh, as the pause banner makes one,
    # counts its pulls from 1 again) and its number.
    tag = (pulled.get("m"), pulled.get("n"))
    last, sent = seen.get(key, ((None, None), []))
    if tag != last:
        have = pulled.get("have")
        if not opts.paused:
            feed.hold(store, have, HOLD_S)  # until there is something new to answer with
    else:
        have = sent[-OVERLAP] if len(sent) >= OVERLAP else (sent[0] if sent else None)
    data = feed.payload(store, have, opts)
    if data.get("reset"):
        sent = []
    if not sent or sent[-1] != data.get("id"):
        sent = [*sent, data.get("id")][-OVERLAP:]
    seen[key] = (tag, sent)
    data["answer"], data["answer_m"] = pulled.get("n"), pulled.get("m")  # which pull this answers
    if hidden:
        data["hidden"] = True
    policies = session.LIVE_SENT_POLICY.setdefault()
    policy = (data.pop("config", None) or {}).get("policy", policies.get(key))
    fresh = data.get("reset") or pulled.get("have") is None  # the browser may have nothing
    if fresh:
        data["assets"] = _assets_urls()
    if fresh or policies.get(key) != policy:
        policies[key] = policy
        data["style"] = style()
        data["captions"] = {k: _html(v) for k, v in captions(policy).items()}
    _component(key=key, data=data, on_pull_change=_pulled, height="content")
    return feed


def recording_charts(
    key: str,
    record: Recorded,
    title: str,
    axes: dict[str, Any],
    link: str,
    xmode: str,
    captions: dict[str, str],
) -> None:
    """A recording drawn whole by the same charts (compare): one batch, no pulls. `axes` (per
    x mode: `x` range and `y_top`) fix the scale; views of one `link` group zoom together."""
    memo = session.RECORDING_BATCHES.setdefault()
    ident = (title, len(record.steps), xmode)
    if key not in memo or memo[key][0] != ident:  # encoded once per recording and x mode
        batch = record.batch(xmode)
        batch.pop("config", None)
        memo[key] = (ident, batch)
    data = {**memo[key][1], "id": "|".join(map(str, ident)), "static": True, "axes": axes}
    data.update(title=title, link=link, assets=_assets_urls(), style=style())
    data["captions"] = {k: _html(v) for k, v in captions.items()}
    _component(key=key, data=data, height="content")


def sweep_plot(
    key: str, rows: list[dict[str, Any]], title: str, caption: str, on_select: Callable[[], None]
) -> None:
    """The sweep's trade-off plot; a clicked point's run file comes back as the component's
    `selected` state (`{"run": name, "n": clicks}`), and `on_select` runs."""
    data = {"mode": "sweep", "rows": rows, "title": title, "caption": _html(caption)}
    data.update(assets=_assets_urls(), style=style())
    _component(key=key, data=data, on_selected_change=on_select, height="content")


def kv_page_map(key: str, page_map: dict[str, Any] | None, message: str = "") -> None:
    """Draw the engine's `kv_map` reply, one cell per page."""
    data = {"mode": "kvmap", "map": page_map, "message": message, "assets": _assets_urls()}
    data["style"] = style()
    _component(key=key, data=data, height="content")


def _pulled() -> None:
    """The browser drew a batch and wants the next: rerunning the fragment is the answer."""
