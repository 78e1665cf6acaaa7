"""The fleet page over a fleet recording (Streamlit): the live fleet page's views, replayed.

Open one with `streamlit run app/main.py -- --fleet-trace DIR`, STEPSCOPE_FLEET_TRACE=DIR, or the
sidebar's "Fleet recording" (DIR: `python -m engine.server.fleet --trace-dir DIR`, one
replica-<i>.jsonl per replica). Each replica's trace is replayed through its own
app/replay.py `ReplaySource` and drawn through a `ReplayLink` with app/page/fleet.py's views, every
replica on the fleet's one clock (`clock_epoch`). One scrubber (a time on that clock) and one
player move every replica together; the summary table covers each replica's whole recording;
the controls and the prompt form are shown disabled, with the reason. "Compare with" a second
fleet recording (the same workload under another gateway policy, say) adds a table of both
fleets' figures, per replica and for the fleet, and their differences.

Like the live fleet's connections, the open recording is one per app process: every tab shows
the same replay at the same position.
"""

from __future__ import annotations

import math
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from app import compare
from app.fleet_replay import FLEET, FleetRecording, FleetReplay, compare_rows, trace_dir_from
from app.live.component import recording_charts
from app.live.feed import Recorded
from app.page import fleet as fleet_ui
from app.panels import captions
from app.replay import SPEEDS

PLAY_REFRESH_S = 0.5
CHARTS_LINK = "fleet-replay"  # the replicas' charts zoom and pan together
# how long the last drawing of each recording's charts took: while playing they are redrawn
# whole, every PLAY_REFRESH_S or twice that long, whichever is longer (a long recording's
# charts take a while to encode, and the page must keep time for the scrubber and the clicks)
_DRAW_S: dict[str, float] = {}
NO_ENGINE = "a replay has no engine to act on (clear the fleet recording to go back to engines)."


@dataclass(frozen=True, slots=True)
class Opened:
    folder: str | None  # the fleet recording to replay
    compare: str | None  # a second one to compare it with


def _tag(folder: str) -> str:
    """A short name of the recording for the keys of its widgets (a new one starts afresh)."""
    return f"{zlib.crc32(folder.encode()):08x}"


def _norm(folder: str) -> str:
    return str(Path(folder).expanduser().resolve())


@st.cache_resource(max_entries=4, show_spinner="Loading the fleet recording…")
def load(folder: str) -> FleetRecording:
    """A fleet recording, loaded once per app process (a ValueError is not kept)."""
    return FleetRecording.load(folder)


def _close(replay: FleetReplay) -> None:
    replay.close()


@st.cache_resource(max_entries=1, on_release=_close, show_spinner=False)
def fleet_replay(folder: str) -> FleetReplay:
    return FleetReplay(load(folder))


@st.cache_resource(max_entries=1, show_spinner=False)
def _axes(folder: str) -> dict[str, dict[str, Any]]:
    """One scale for every replica's charts: the fleet's whole time span, and the tallest batch
    of any replica (so nothing rescales while the recording plays)."""
    fleet = load(folder)
    top = max(compare.batch_peak([r.messages[i] for i in r.step_at]) for r in fleet.recordings)
    return {"time": {"x": [fleet.start, fleet.end], "y_top": top}}


@st.cache_resource(max_entries=1, show_spinner=False)
def _shifted(folder: str) -> list[fleet_ui.ClockShift]:
    """Each replica's replay store on the fleet's clock."""
    replay = fleet_replay(folder)
    out = []
    for source, offset in zip(replay.sources, replay.fleet.offsets, strict=True):
        shifted = fleet_ui.ClockShift(source.store)
        shifted.offset = offset
        out.append(shifted)
    return out


def sidebar() -> Opened:
    """The sidebar's "Fleet recording": which fleet recording (if any) the page replays."""
    given = trace_dir_from(sys.argv[1:], os.environ)
    with st.sidebar.expander("Fleet recording", expanded=given is not None):
        typed = st.text_input(
            "Open fleet recording",
            key="fleet_trace_path",
            placeholder="DIR of replica-<i>.jsonl" if not given else given,
            help="A folder from `python -m engine.server.fleet --trace-dir DIR`: one trace per "
            "replica, replayed side by side. Clear it to go back to the engines.",
        ).strip()
        folder = typed or given
        compare = None
        if folder:
            compare = st.text_input(
                "Compare with fleet recording",
                key="fleet_compare_path",
                placeholder="another --trace-dir DIR",
                help="The same workload under another gateway policy, say: a table of both "
                "fleets' figures and their differences.",
            ).strip()
    return Opened(_norm(folder) if folder else None, _norm(compare) if compare else None)


# ---- the player -------------------------------------------------------------------------------


def _player(folder: str, timed: bool) -> None:
    """The scrubber (a time on the fleet's clock), play/pause, the speed, and the summary."""
    replay = fleet_replay(folder)
    fleet = replay.fleet
    if timed and not replay.playing:  # playback ended: drop this fragment's timer
        st.rerun()
    # the scrubber reads the fleet's clock, as the charts' x axis does
    lo, hi = math.floor(fleet.start * 100) / 100, math.ceil(fleet.end * 100) / 100
    now = min(max(round(replay.position, 2), lo), hi)
    cols = st.columns([7, 1.2, 2.2])
    label = "Fleet time (s)"
    help_ = "Every replica as it stood at this time on the fleet's clock (the charts' x axis)."
    if replay.playing or hi <= lo:  # moving (or nothing to move): shown, not set
        cols[0].slider(label, lo, max(hi, lo + 0.01), now, disabled=True, help=help_)
    else:
        key = f"fleet_replay_t_{_tag(folder)}_{replay.generation}"
        picked = cols[0].slider(label, lo, hi, now, step=0.01, help=help_, key=key)
        if abs(picked - now) > 1e-6:  # the slider's ends are the recording's, not rounded
            t = fleet.end if picked >= hi else fleet.start if picked <= lo else picked
            replay.seek(t, moved_here=True)
    if cols[1].button(
        ":material/pause: Pause" if replay.playing else ":material/play_arrow: Play",
        key="fleet_replay_play",
        width="stretch",
    ):
        if replay.playing:
            replay.pause()
        else:
            replay.play()
        st.rerun()  # the whole page: this fragment's timer follows the player
    speed = cols[2].select_slider("Speed", options=SPEEDS, key="fleet_replay_speed",
                                  format_func=lambda v: f"{v}×")  # fmt: skip
    if float(speed) != replay.speed:
        replay.set_speed(float(speed))
    state = "playing" if replay.playing else "at the end" if replay.at_end else "paused"
    st.caption(
        f"t = {replay.position:.2f} s on the fleet's clock ({replay.position - fleet.start:.2f} "
        f"s of the {fleet.end - fleet.start:.2f} s from the first step to the last) · {state}. "
        + " · ".join(
            f"{name}: "
            + ("no step yet" if src.current_step is None else f"step {src.current_step}")
            for name, src in zip(fleet.names, replay.sources, strict=True)
        )  # fmt: skip
    )
    rows = fleet_ui.fleet_rows(replay.links, fleet.summaries)
    for row, name in zip(rows, fleet.names, strict=True):
        row["replica"], row["state"] = name, state
        row.pop("engine", None)
    rows.append({"replica": FLEET, **fleet_ui.figures(fleet.total)})
    fleet_ui.summary_table(
        replay.links,
        rows,
        caption="The figures (requests to worst stall) cover each replica's whole recording "
        "(instrumentation.fold.summarize of its trace) and, in the last row, the whole fleet's "
        "(instrumentation.fleet.summarize_fleet: requests pooled, tokens over the fleet's "
        "span); running, waiting, KV and the config are each replica's at the scrubber's time.",
    )


# ---- the page ---------------------------------------------------------------------------------


def _charts(folder: str) -> None:
    """Every replica as it stood at the scrubber's time, drawn whole on one scale (the fleet's
    time span on x): the same place on the page is the same moment on every replica."""
    started = time.perf_counter()
    replay = fleet_replay(folder)
    fleet = replay.fleet
    axes = _axes(folder)
    for i, (name, src) in enumerate(zip(fleet.names, replay.sources, strict=True)):
        st.markdown(f"#### {name} · `{src.recording.name}`")
        shown = _shifted(folder)[i].delta(None)
        config = shown.config or {}
        recording_charts(
            f"fleet-replay-charts-{_tag(folder)}-{i}",
            Recorded(shown.steps, shown.requests, shown.engine, config),
            title=f"{name}: up to step {src.current_step}"
            if src.current_step is not None
            else f"{name}: no step yet",
            axes=axes,
            link=CHARTS_LINK,
            xmode="time",
            captions=captions(config.get("policy")),
        )
    _DRAW_S[folder] = time.perf_counter() - started


def _fmt(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def comparison(fleet: FleetRecording, folder: str) -> None:
    st.markdown("### Compare fleet recordings")
    try:
        other = load(folder)
    except ValueError as exc:
        st.error(f"Compare with: {exc}")
        return
    rows = [{k: _fmt(v) for k, v in r.items()} for r in compare_rows(fleet, other)]
    st.dataframe(rows, hide_index=True, key="fleet_compare_table")
    st.caption(
        f"A: `{fleet.folder}` ({len(fleet.recordings)} replicas) · B: `{other.folder}` "
        f"({len(other.recordings)} replicas). Each replica's figures are "
        "instrumentation.fold.summarize of its whole trace; the fleet's, "
        "instrumentation.fleet.summarize_fleet of all of them (requests pooled, output tokens "
        "over the fleet's span on one clock). The "
        "prefix-cache hit rate is the share of admitted prompt tokens the radix cache served."
    )


def render(opened: Opened) -> None:
    """The fleet page over the open fleet recording ."""
    assert opened.folder is not None
    try:
        replay = fleet_replay(opened.folder)
    except ValueError as exc:
        st.error(f"Open fleet recording: {exc}")
        return
    fleet = replay.fleet
    n = len(fleet.recordings)
    st.markdown(f"## :material/hub: stepscope: a fleet recording of {n} replicas")
    st.caption(
        f"Replaying `{fleet.folder}`: each replica's trace through its own replay, every "
        "replica on one clock (the first engine's, by each trace's `hello.engine.clock_epoch`) "
        "and one scale. No engine: nothing can be sent."
    )
    if not fleet.aligned:
        st.warning("Some traces carry no clock_epoch (an older server): those replicas are drawn "
                   "on their own clock, not aligned with the others.")  # fmt: skip
    # Paused, the page is static and a scrub reruns it whole (charts included); playing, the
    # player and the charts redraw themselves every PLAY_REFRESH_S.
    playing = replay.playing
    if playing:
        st.fragment(_player, run_every=PLAY_REFRESH_S)(opened.folder, True)
    else:
        _player(opened.folder, False)
    fleet_ui.controls_form(replay.links, disabled=NO_ENGINE)
    urls = tuple(link.url for link in replay.links)
    fleet_ui.prompt_form(replay.links, fleet_ui.FleetSpec(urls, source=str(fleet.folder)),
                         disabled=NO_ENGINE)  # fmt: skip
    if opened.compare:
        comparison(fleet, opened.compare)
    if playing:
        every = max(PLAY_REFRESH_S, 2 * _DRAW_S.get(opened.folder, 0.0))
        st.fragment(_charts, run_every=every)(opened.folder)
    else:
        _charts(opened.folder)
