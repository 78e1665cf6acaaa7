"""The recording page: a recorded run replayed, with the live page's views and no engine.

Every view reads the replay's store exactly as the live page reads a connection's (app/replay.py),
so a recording shows the figures the live page showed. Above the charts: a step scrubber,
play/pause and the speed (1×–50×). The headline and the player are drawn in the charts' own
fragment: a fragment of its own, on a timer, lost its turns to the charts' pulls (several a
second) and stood still while the charts played on.
"""

from __future__ import annotations

import streamlit as st

from app import controls, panels, session, sidebar
from app.live.component import LIVE_EVERY_S
from app.page import common
from app.replay import SPEEDS, ReplayLink, ReplaySource

REFRESH_S = sidebar.REFRESH_S
NO_ENGINE = "a recording has no engine to act on (close it to go back to the engine)."


def _source() -> ReplaySource | None:
    return session.REPLAY_SOURCE.get()


def _on_scrub() -> None:
    # Drawn disabled (playing), the slider is moved only by the replay: a change from it is the
    # browser sending back a value it showed a moment ago, behind the replay (seen: the replay
    # thrown back to its first step). Asked of the slider as drawn, not of the replay now:
    # Pause's callback may run first. player() puts the slider back.
    if (src := _source()) is None or session.REPLAY_SCRUB_LOCKED.get():
        return
    step = int(session.REPLAY_STEP.get() or 0)
    src.seek(step)
    session.REPLAY_STEP_SHOWN.set(step)  # the slider shows it already


def _on_play() -> None:
    src = _source()
    if src is None:
        return
    if src.playing:
        src.pause()
        return
    if src.at_end and src.recording.first_step is not None:  # play again from the start
        src.seek(src.recording.first_step)
    src.play(float(session.REPLAY_SPEED.get()))


def _on_speed() -> None:
    if (src := _source()) is not None:
        src.set_speed(float(session.REPLAY_SPEED.get()))


def config_note(step: dict | None) -> str:
    """The budget, policy and admission a recorded step ran under."""
    if step is None:
        return "no step yet"
    policy = controls.POLICY_LABELS.get(step.get("policy") or "", step.get("policy") or "?")
    admission = step.get("admission")
    return f"max_extend_tokens {step.get('budget', '?')} · {policy}" + (
        f" · {controls.ADMISSION_LABELS.get(admission, admission)}" if admission else ""
    )


def player(src: ReplaySource) -> None:
    """The scrubber follows the replay: it is set from the cursor whenever the cursor moved
    otherwise than by the scrubber (playing, Play from the start, a recording opened). Not when
    the user moved it: setting a widget sends the browser its value, which replaced what the
    user had done since (seen: End, Home, → and → left the scrubber at the end)."""
    rec = src.recording
    step = src.current_step if src.current_step is not None else rec.first_step
    # A value that reached the slider while it was drawn disabled is the browser's stale one
    # (Streamlit stores it, and skips the callback): seen with Pause's click, the slider left at
    # step 3 under a caption at step 163. It is put back too.
    if (
        step != session.REPLAY_STEP_SHOWN.get()
        or session.REPLAY_STEP.get() is None
        or session.REPLAY_SCRUB_LOCKED.get()
    ):
        session.REPLAY_STEP.set(step)
        session.REPLAY_STEP_SHOWN.set(step)
    cols = st.columns([7, 1.2, 2.2])
    session.REPLAY_SCRUB_LOCKED.set(src.playing and rec.num_steps >= 2)
    if rec.num_steps >= 2:
        cols[0].slider("Step", min_value=rec.first_step, max_value=rec.last_step,
                       key=session.REPLAY_STEP.key, on_change=_on_scrub, disabled=src.playing,
                       help="Show the recording as it stood when this step had run (Pause "
                       "to move it).")  # fmt: skip
    else:
        cols[0].caption(f"{rec.num_steps} step(s) recorded.")
    cols[1].button(
        ":material/pause: Pause" if src.playing else ":material/play_arrow: Play",
        key="replay_play",
        on_click=_on_play,
        width="stretch",
    )
    session.REPLAY_SPEED.setdefault()
    cols[2].select_slider("Speed", options=SPEEDS, key=session.REPLAY_SPEED.key,
                          on_change=_on_speed, format_func=lambda v: f"{v}×")  # fmt: skip
    state = "playing" if src.playing else "at the end" if src.at_end else "paused"
    last = src.store.snapshot(last_steps=1).steps
    st.caption(
        f"Replay of `{rec.name}`: step {src.current_step} of {rec.first_step}–{rec.last_step}, "
        f"t = {src.current_time - rec.times[0]:.2f} s of {rec.duration:.2f} s · {state} · "
        f"{config_note(last[-1] if last else None)}"
    )


def _replayed(src: ReplaySource) -> None:
    """The headline, the player and the charts, drawn together so that they show one moment."""
    link = ReplayLink(src)
    common.headline(link)
    player(src)
    common.paused_banner()
    panels.live_charts(link)


def render(src: ReplaySource) -> None:
    link = ReplayLink(src)
    with st.sidebar:
        st.subheader("Scheduling")
        st.caption(
            "The budget, policy and admission as recorded are shown with each step, above the "
            "charts; " + NO_ENGINE
        )
    sidebar.view_section(link)
    sidebar.session_section(link, recording=True)
    common.header(f"A recording, replayed: `{src.recording.name}`. " + common.TAGLINE)
    common.notices_line()
    st.fragment(_replayed, run_every=LIVE_EVERY_S)(src)
    st.fragment(common.detail_views, run_every=REFRESH_S)(link, NO_ENGINE)
