"""The sidebar's "Recording" section: what opens the recording, comparison and sweep pages.

Open a recording (a path, or an upload; also `streamlit run app/main.py -- --trace FILE` or
STEPSCOPE_TRACE=FILE) and close it to go back to the engine; "Compare with…" a second
recording; "Open sweep folder". What is open is this tab's (app/session.py), and app/main.py
picks the page from it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import streamlit as st

from app import rerun, session, sweep_view
from app.replay import Recording, ReplaySource, open_recording


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
    session.NOTICES.pop()  # the status line spoke of the page left behind
    if recording.last_step is not None:
        session.REPLAY_STEP.set(recording.last_step)
    session.reset_views()
    return src


def close_source() -> None:
    old = session.REPLAY_SOURCE.pop()
    if old is not None:
        old.pause()
    session.NOTICES.pop()
    session.reset_views()


def _load(what: str, path_or_file: Any) -> Recording | None:
    try:
        return open_recording(path_or_file)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        session.REPLAY_ERROR.set(f"{what}: {exc}")
        return None


def _on_open_path() -> None:
    path = str(session.REPLAY_PATH.get() or "").strip()
    session.REPLAY_PATH_TRIED.set(path)
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
        close_source()  # the sweep's page shows; a click on a point opens one of its runs
    except (OSError, ValueError) as exc:
        session.REPLAY_ERROR.set(f"Open sweep folder: {exc}")


def open_compared() -> None:
    """Make the comparison's B the replayed recording (its timeline in every view)."""
    rec = session.REPLAY_COMPARE.get()
    src = source()
    if rec is None:
        return
    if src is not None:  # what was shown becomes the other side of the comparison
        session.REPLAY_COMPARE.set(src.recording)
    open_source(rec)


def on_sweep_select() -> None:
    sweep = session.REPLAY_SWEEP.get()
    event = session.SWEEP_CHART.get()
    path = sweep_view.selected_run(sweep, event) if sweep is not None else None
    if path is not None and (rec := _load("Open run", path)) is not None:
        open_source(rec)


# ---- the sidebar ------------------------------------------------------------------------------


def sidebar() -> None:
    """The "Recording" section (and `--trace FILE`, opened once when the tab opens)."""
    pending = None
    if not session.REPLAY_ARGV_DONE.get():  # `--trace FILE`: opened once, when the tab opens
        session.REPLAY_ARGV_DONE.set(True)
        pending = trace_argument()
    if pending is not None and (rec := _load("Open recording", Path(pending))) is not None:
        open_source(rec)
    if rerun.path_unopened():  # a value not yet acted on (app/rerun.py)
        _on_open_path()
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
            back = "the sweep" if session.REPLAY_SWEEP.get() is not None else "the engine"
            st.button("Close recording", key="replay_close", on_click=close_source,
                      help=f"Back to {back}.", width="stretch")  # fmt: skip
        st.text_input(
            "Open recording",
            key=session.REPLAY_PATH.key,
            on_change=_on_open_path,
            placeholder="path/to/trace.jsonl",
            help="A `--trace` JSONL from the server, or this page's Trace (JSONL) download.",
        )
        st.file_uploader("…or upload one", type=["jsonl", "json"], key=session.REPLAY_UPLOAD.key,
                         on_change=_on_upload, label_visibility="collapsed")  # fmt: skip
        other = session.REPLAY_COMPARE.get()
        with st.expander("Compare with…", expanded=other is not None):
            if other is not None:
                st.caption(f"B: `{other.name}`" + ("" if src is not None else
                           " · open a recording (A) to compare it with"))  # fmt: skip
                st.button("Close comparison", key="compare_close", width="stretch",
                          on_click=session.REPLAY_COMPARE.pop)  # fmt: skip
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
                placeholder="DIR of python -m bench.sweep --out DIR",
            )
            if session.REPLAY_SWEEP.get() is not None:
                st.button("Close sweep", key="sweep_close", width="stretch",
                          on_click=session.REPLAY_SWEEP.pop)  # fmt: skip
        if error := session.REPLAY_ERROR.get():
            st.error(error)
