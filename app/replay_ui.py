"""The page's replay, compare and sweep controls (Streamlit).

- Sidebar, "Recording": open a recording (a path, or an upload; also `streamlit run app/main.py
  -- --trace FILE` or STEPSCOPE_TRACE=FILE), close it to go back to the engine; "Compare with…" a
  second recording; "Open sweep folder".
- Main area, while a recording is open: a step scrubber, play/pause and the speed (1×–50×).
  Under the page's views: the comparison (two timelines on aligned axes and a table) and the
  sweep's trade-off curve, where a click on a point opens that run.

While a recording is open, the page's link is a `ReplayLink`: every view reads the replay's
store exactly as it reads a live connection's (app/replay.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from app import compare, session, sweep_view
from app import panels as views
from app.replay import MAX_SPEED, MIN_SPEED, Recording, ReplayLink, ReplaySource, open_recording

SPEEDS = session.SPEEDS
PLAY_REFRESH_S = 0.5
assert MIN_SPEED == SPEEDS[0] and MAX_SPEED == SPEEDS[-1]


def trace_argument(argv: list[str] | None = None) -> str | None:
    """`streamlit run app/main.py -- --trace FILE` (or STEPSCOPE_TRACE=FILE)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--trace")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args.trace or os.environ.get("STEPSCOPE_TRACE") or None


def source() -> ReplaySource | None:
    return session.REPLAY_SOURCE.get()


# ---- opening and closing (callbacks, or before any widget is drawn) -----------------------------


def open_source(recording: Recording) -> ReplaySource:
    """Replace the page's source with `recording`, shown whole (the cursor at its end)."""
    old = source()
    if old is not None:
        old.pause()
    src = ReplaySource(recording)
    src.seek_end()
    session.REPLAY_SOURCE.set(src)
    session.REPLAY_ERROR.pop()
    if recording.last_step is not None:
        session.REPLAY_STEP.set(recording.last_step)
    session.reset_views()
    return src


def close_source() -> None:
    old = session.REPLAY_SOURCE.pop()
    if old is not None:
        old.pause()
    session.reset_views()


def _load(what: str, path_or_file: Any) -> Recording | None:
    try:
        return open_recording(path_or_file)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        session.REPLAY_ERROR.set(f"{what}: {exc}")
        return None


def _on_open_path() -> None:
    path = str(session.REPLAY_PATH.get() or "").strip()
    if path and (rec := _load("Open recording", Path(path).expanduser())) is not None:
        open_source(rec)


def _on_upload() -> None:
    upload = session.REPLAY_UPLOAD.get()
    if upload is not None and (rec := _load("Open recording", upload)) is not None:
        open_source(rec)


def _on_compare_path() -> None:
    path = str(session.COMPARE_PATH.get() or "").strip()
    if path and (rec := _load("Compare with", Path(path).expanduser())) is not None:
        session.REPLAY_COMPARE.set(rec)
        session.REPLAY_ERROR.pop()


def _on_compare_upload() -> None:
    upload = session.COMPARE_UPLOAD.get()
    if upload is not None and (rec := _load("Compare with", upload)) is not None:
        session.REPLAY_COMPARE.set(rec)
        session.REPLAY_ERROR.pop()


def _on_sweep_path() -> None:
    path = str(session.SWEEP_PATH.get() or "").strip()
    try:
        session.REPLAY_SWEEP.set(sweep_view.load(path))
        session.REPLAY_ERROR.pop()
    except (OSError, ValueError) as exc:
        session.REPLAY_ERROR.set(f"Open sweep folder: {exc}")


def _open_compared() -> None:
    """Make the comparison's B the replayed recording (its timeline in every view)."""
    rec = session.REPLAY_COMPARE.get()
    src = source()
    if rec is None:
        return
    if src is not None:  # what was shown becomes the other side of the comparison
        session.REPLAY_COMPARE.set(src.recording)
    open_source(rec)


def _on_sweep_select() -> None:
    sweep = session.REPLAY_SWEEP.get()
    event = session.SWEEP_CHART.get()
    path = sweep_view.selected_run(sweep, event) if sweep is not None else None
    if path is not None and (rec := _load("Open run", path)) is not None:
        open_source(rec)


# ---- the sidebar ------------------------------------------------------------------------------


def sidebar() -> ReplayLink | None:
    """The "Recording" section; returns the replay's link while a recording is open."""
    pending = None
    if not session.REPLAY_ARGV_DONE.get():  # `--trace FILE`: opened once, when the tab opens
        session.REPLAY_ARGV_DONE.set(True)
        pending = trace_argument()
    if pending is not None and (rec := _load("Open recording", Path(pending))) is not None:
        open_source(rec)
    with st.sidebar:
        st.subheader("Recording")
        src = source()
        if src is not None:
            rec = src.recording
            st.markdown(f":blue[●] **replaying** `{rec.name}`")
            st.caption(
                f"{len(rec.messages):,} messages · {rec.num_steps:,} steps · "
                f"{rec.duration:.1f} s of engine time. No engine: commands are refused."
            )
            st.button("Close recording", key="replay_close", on_click=close_source,
                      help="Back to the engine connection.", width="stretch")  # fmt: skip
        st.text_input(
            "Open recording",
            key=session.REPLAY_PATH.key,
            on_change=_on_open_path,
            placeholder="path/to/trace.jsonl",
            help="A `--trace` JSONL from the server, or this page's Trace (JSONL) download.",
        )
        st.file_uploader("…or upload one", type=["jsonl", "json"], key=session.REPLAY_UPLOAD.key,
                         on_change=_on_upload, label_visibility="collapsed")  # fmt: skip
        with st.expander("Compare with…", expanded=session.REPLAY_COMPARE.get() is not None):
            st.text_input(
                "Second recording",
                key=session.COMPARE_PATH.key,
                on_change=_on_compare_path,
                placeholder="path/to/other.jsonl",
            )
            st.file_uploader("…or upload it", type=["jsonl", "json"], key=session.COMPARE_UPLOAD.key,
                             on_change=_on_compare_upload, label_visibility="collapsed")  # fmt: skip
        with st.expander("Open sweep folder", expanded=session.REPLAY_SWEEP.get() is not None):
            st.text_input(
                "Sweep folder",
                key=session.SWEEP_PATH.key,
                on_change=_on_sweep_path,
                placeholder="DIR of python -m engine.bench --workload sweep --out DIR",
            )
        if error := session.REPLAY_ERROR.get():
            st.error(error)
    src = source()
    return ReplayLink(src) if src is not None else None


# ---- the main area ----------------------------------------------------------------------------


def _on_scrub() -> None:
    src = source()
    if src is not None:
        src.seek(int(session.REPLAY_STEP.get() or 0))


def _on_play() -> None:
    src = source()
    if src is None:
        return
    if src.playing:
        src.pause()
        return
    if src.at_end and src.recording.first_step is not None:  # play again from the start
        src.seek(src.recording.first_step)
    src.play(float(session.REPLAY_SPEED.get()))


def _on_speed() -> None:
    src = source()
    if src is not None:
        src.set_speed(float(session.REPLAY_SPEED.get()))


def _player(src: ReplaySource) -> None:
    rec = src.recording
    if src.playing or session.REPLAY_STEP.get() is None:
        step = src.current_step
        session.REPLAY_STEP.set(step if step is not None else rec.first_step)
    cols = st.columns([7, 1.2, 2.2])
    if rec.num_steps >= 2:
        cols[0].slider(
            "Step",
            min_value=rec.first_step,
            max_value=rec.last_step,
            key=session.REPLAY_STEP.key,
            on_change=_on_scrub,
            help="Show the recording as it stood when this step had run.",
        )
    else:
        cols[0].caption(f"{rec.num_steps} step(s) recorded.")
    cols[1].button(
        ":material/pause: Pause" if src.playing else ":material/play_arrow: Play",
        key="replay_play",
        on_click=_on_play,
        width="stretch",
    )
    session.REPLAY_SPEED.setdefault()
    cols[2].select_slider("Speed", options=SPEEDS, key=session.REPLAY_SPEED.key, on_change=_on_speed,
                          format_func=lambda v: f"{v}×")  # fmt: skip
    state = "playing" if src.playing else "at the end" if src.at_end else "paused"
    st.caption(
        f"Replay of `{rec.name}`: step {src.current_step} of {rec.first_step}–{rec.last_step}, "
        f"t = {src.current_time - rec.times[0]:.2f} s of {rec.duration:.2f} s · {state}"
    )


def _player_fragment() -> None:
    src = source()
    if src is not None:
        _player(src)


def main_controls() -> None:
    """The scrubber and play/pause, above the page's views, while a recording is open."""
    src = source()
    if src is None:
        return
    every = PLAY_REFRESH_S if src.playing else None
    st.fragment(_player_fragment, run_every=every)()


def _fmt(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def comparison() -> None:
    rec_b = session.REPLAY_COMPARE.get()
    if rec_b is None:
        return
    src = source()
    st.markdown("### Compare")
    if src is None:
        st.info("Open a recording first: the comparison is the open recording (A) against "
                f"`{rec_b.name}` (B).")  # fmt: skip
        return
    a, b = compare.side(src.recording), compare.side(rec_b)
    rows = [{k: _fmt(v) for k, v in r.items()} for r in compare.table(a, b)]
    st.dataframe(pd.DataFrame(rows), hide_index=True, key="compare_table")
    views.compare_charts(a, b, xmode=session.XMODE.get())
    st.button(f"Open B ({rec_b.name}) in the page", key="compare_open_b",
              on_click=_open_compared)  # fmt: skip


def sweep_panel() -> None:
    sweep = session.REPLAY_SWEEP.get()
    if sweep is None:
        return
    st.markdown("### Sweep")
    views.sweep_chart(sweep, on_select=_on_sweep_select)
    st.dataframe(pd.DataFrame([_row(r) for r in sweep.rows]), hide_index=True)


def _row(row: Any) -> dict[str, Any]:
    return {name: _fmt(getattr(row, name)) for name in row.__slots__}


def panels() -> None:
    """Below the page's views: the comparison and the sweep, when open."""
    comparison()
    sweep_panel()
