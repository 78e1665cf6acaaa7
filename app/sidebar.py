"""The sidebar: engine status, scheduling controls, workload presets, view and session tools.

Controls act through callbacks, which run before the script and send protocol commands; the
sidebar then shows the engine's config, so a change made elsewhere (a preset, another tab) shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamlit as st

from app import controls, export, rerun, session, workloads
from app.client import EngineLink
from app.external import ExternalMode

REFRESH_S = 1.0
DEFAULT_BUDGET = session.DEFAULT_BUDGET
OWN_ENGINE = ExternalMode(False)  # an engine of our own: every control acts


class Target:
    """The engine URL shared by every tab of the app process (a cached resource holds it)."""

    def __init__(self, url: str) -> None:
        self.url = url


def _on_url(target: Target) -> None:
    url = str(session.URL.get()).strip()
    if not url:
        # No engine is reachable at "": keep the one every tab follows. (A browser whose URL box
        # was redrawn empty by a rerun sends "" with its next click, seen on the fleet page after
        # Apply; taking it would move every tab of the process to "no engine URL".)
        session.URL.set(target.url)
        return
    target.url = url


# ---- callbacks (run before the script, so widget state can still be changed) -----------------


def _apply_config(link: EngineLink, **fields: object) -> None:
    try:
        command = controls.set_config(**fields)  # type: ignore[arg-type]
    except ValueError as exc:
        session.notify(False, str(exc))
        return
    reply = session.send(link, command, "set_config")
    if reply is not None and reply.get("type") == "config":
        rerun.remember_own({k: reply.get(k) for k in rerun.SYNCED})


def _on_budget_slider(link: EngineLink) -> None:
    value = int(session.BUDGET_SLIDER.get())
    if rerun.stale("max_extend_tokens", value):
        return
    rerun.replaced("max_extend_tokens")
    session.BUDGET_EXACT.set(str(value))
    _apply_config(link, max_extend_tokens=value)


def _on_budget_exact(link: EngineLink) -> None:
    typed = str(session.BUDGET_EXACT.get()).strip()
    try:
        value = controls.parse_budget(typed)
    except ValueError as exc:
        session.notify(False, str(exc))
        rerun.show_in_force("max_extend_tokens")
        return
    if rerun.stale("max_extend_tokens", value):
        return
    rerun.replaced("max_extend_tokens")
    session.BUDGET_SLIDER.set(value)
    _apply_config(link, max_extend_tokens=value)


def _on_policy(link: EngineLink) -> None:
    if rerun.stale("policy", session.POLICY.get()):
        return
    _apply_config(link, policy=session.POLICY.get())


def _on_admission(link: EngineLink) -> None:
    admission = session.ADMISSION.get()
    if rerun.stale("admission", admission):
        return
    _apply_config(link, admission=admission)
    running = sum(r.get("state") == "running" for r in link.store.snapshot(last_steps=0).requests)
    if running:  # nothing visible changes until they finish: say why
        session.notify(
            True,
            f"admission={admission} applies to requests admitted from the next step; the "
            f"{running} running keep what was promised them, so the pool changes as they end.",
        )


def _start_preset(link: EngineLink, preset: workloads.Preset) -> None:
    run = workloads.PresetRun(preset).start(link)
    if link.status().state == "connected":
        session.add_run(run)
        session.notify(True, f"workload “{preset.title}” started")
    else:
        session.hold(run, f"workload “{preset.title}” held: it starts once the engine is up")


def _clear(link: EngineLink) -> None:
    link.store.clear()
    session.reset_views(keep_live=True)  # the charts start afresh: no zoom on the old run
    session.FROZEN.set(link.store.snapshot() if not session.is_live() else None)
    session.notify(True, "history cleared (the engine keeps running)")


# ---- sidebar ----------------------------------------------------------------------------------


def external_line(engine: dict) -> str:
    """An external engine watched from its output: what is read, and what it says of itself."""
    model = engine.get("model")
    watch = engine.get("watch") or {}
    counts = " · ".join(f"{watch[k]:,} {k}" for k in ("lines", "steps", "unreadable") if k in watch)
    return (
        f"external engine · **{engine.get('source', '?')}**"
        + (f" · {model}" if model else "")
        + (f"  \n{counts}" if counts else "")
    )


def engine_line(engine: dict) -> str:
    """Where and how the engine runs: model, device, dtype, attention backend, pool, TP degree."""
    if engine.get("external"):
        return external_line(engine)
    backend = engine.get("attention_backend")
    tp = int(engine.get("tp_size") or 1)
    return (
        f"{engine.get('model', '?')} · **{engine.get('device', '?')}** · "
        f"{engine.get('dtype', '?')}"
        + (f" · **TP {tp}** (tensor parallel over {tp} ranks)" if tp > 1 else "")
        + (f" · {backend} attention" if backend else "")
        + f"  \n{engine.get('num_pages', 0):,} pages × "
        f"{engine.get('page_size', 1)} token · {engine.get('cache_type', 'prefix')} cache"
        + (" · overlapped steps" if engine.get("overlap") else "")
        + (" · batch-invariant" if engine.get("batch_invariant") else "")
    )


def connection_badge(link: EngineLink, outdated: Callable[[EngineLink], bool]) -> None:
    if outdated(link):  # the engine came up since the page was drawn: draw it whole, once
        st.rerun(scope="app")
    status = link.status()
    engine, _ = session.engine_facts(link)
    if status.state == "connected":
        st.markdown(":green[●] **connected**")
        if engine:
            st.caption(engine_line(engine))
    elif status.state == "connecting":
        st.markdown(":orange[●] **connecting…**")
    else:
        st.markdown(":red[●] **not connected**")
        st.caption("Engine starting or unreachable: prompts and workloads are held until it is up.")


def engine_section(
    target: Target,
    link: EngineLink | None = None,
    mode: ExternalMode = OWN_ENGINE,
    outdated: Callable[[EngineLink], bool] = lambda link: False,
) -> None:
    """The engine URL and, with a link, its connection badge. `outdated(link)` says the page
    was drawn before something the full page shows (the engine's config, a held prompt sent):
    the badge's fragment then redraws it."""
    with st.sidebar:
        st.subheader("Engine")
        st.text_input(
            "Engine URL",
            key=session.URL.key,
            on_change=_on_url,
            args=(target,),
            help="A stepscope engine server (docs/protocol.md); every tab of this app follows it.",
        )
        if link is None:
            return
        # what this run draws, noted before the badge's fragment asks whether it is outdated
        config = session.engine_facts(link)[1]
        waiting = not config and not session.SYNCED_CONFIG.present()
        rerun.controls_waiting(waiting and mode.commands)
        st.fragment(connection_badge, run_every=REFRESH_S)(link, outdated)


def scheduling_section(link: EngineLink, mode: ExternalMode) -> None:
    """The budget, the policy and the admission mode, at the engine's values."""
    with st.sidebar:
        st.subheader("Scheduling")
        config = session.engine_facts(link)[1]
        if mode.external:
            # A watched engine takes no commands: say so instead of showing dead controls.
            st.caption("Budget and policy: " + mode.disabled_note())
        elif not config and not session.SYNCED_CONFIG.present():
            # Until the engine says what it runs, controls would show made-up values (and send
            # them): say why they are not there yet.
            st.caption("Engine starting… the scheduling controls appear once it is connected.")
        else:
            _scheduling_controls(link, config)


def recorded_config_section(step: dict[str, Any] | None) -> None:
    """A recording's budget, policy and admission as they stood at the step shown: read-only,
    since a recording takes no commands."""
    with st.sidebar:
        st.subheader("Scheduling")
        if step is None:
            st.caption("No step recorded yet.")
            return
        policy = controls.POLICY_LABELS.get(step.get("policy") or "", step.get("policy") or "?")
        admission = step.get("admission")
        st.markdown(
            f"`max_extend_tokens` **{step.get('budget', '?')}** · {policy}"
            + (f" · {controls.ADMISSION_LABELS.get(admission, admission)}" if admission else "")
        )
        st.caption(f"As recorded at step {step.get('step')}; a recording takes no commands.")


def _scheduling_controls(link: EngineLink, config: dict | None) -> None:
    rerun.sync_controls(config)
    left, right = st.columns([3, 1.3])
    left.select_slider(
        "max_extend_tokens",
        options=controls.budget_options(session.BUDGET_SLIDER.get()),
        key=session.BUDGET_SLIDER.key,
        on_change=_on_budget_slider,
        args=(link,),
        help="Prompt tokens per step (the chunk size). Applies from the next step.",
    )
    right.text_input(
        "exact",
        key=session.BUDGET_EXACT.key,
        on_change=_on_budget_exact,
        args=(link,),
        help="Any exact budget: a whole number ≥ 1 (anything else is refused).",
    )
    st.radio(
        "Policy",
        controls.POLICIES,
        format_func=controls.POLICY_LABELS.__getitem__,
        key=session.POLICY.key,
        on_change=_on_policy,
        args=(link,),
        captions=[
            "one kind per step: decode waits while a prompt is chunked",
            "decodes ride along in every step; prompts get the rest",
        ],
        help=f"prefill-first is the policy of {controls.CHAPTER}; mixed is Sarathi-Serve's "
        "stall-free batching.",
    )
    st.radio(
        "Admission",
        controls.ADMISSIONS,
        format_func=controls.ADMISSION_LABELS.__getitem__,
        key=session.ADMISSION.key,
        on_change=_on_admission,
        args=(link,),
        captions=[
            "every page a request may need is promised: nothing is ever retracted",
            "outputs are estimated; when decode runs out of pages, requests are retracted",
        ],
        help="reserve is the chapter's rule; optimistic is SGLang's new_token_ratio. Applies "
        "to requests admitted from the next step on: those already running keep their promise.",
    )


def workloads_section(link: EngineLink, mode: ExternalMode) -> None:
    with st.sidebar:
        st.subheader("Workloads")
        if not mode.commands:
            st.caption("Workloads: " + mode.disabled_note())
        for preset in workloads.PRESETS:
            st.button(
                preset.title,
                key=f"preset-{preset.key}",
                help=preset.help,
                on_click=_start_preset,
                args=(link, preset),
                width="stretch",
                disabled=not mode.commands,
            )


def view_section(link: Any) -> None:
    """Live or paused, how many steps are in view, and the x axis."""
    with st.sidebar:
        st.subheader("View")
        session.LIVE.setdefault()
        st.toggle(
            "Live",
            key=session.LIVE.key,
            on_change=session.freeze,
            args=(link,),
            help="Pause to freeze the charts: zoom and hover without updates undoing it.",
        )
        session.WINDOW.setdefault()
        st.select_slider("Steps in view", options=session.WINDOWS, key=session.WINDOW.key,
                         help="The charts and the headline cover the newest this many steps.")  # fmt: skip
        st.radio("x axis", ("step", "time"), key=session.XMODE.key, horizontal=True)


def session_section(link: Any, recording: bool = False) -> None:
    """Clear history (not for a recording), and the record's two downloads."""
    with st.sidebar:
        st.subheader("Session")
        if not recording:
            st.button("Clear history", key=session.CLEAR.key, on_click=_clear, args=(link,),
                      width="stretch", help="Forget the steps shown (the engine runs on).")  # fmt: skip
        left, right = st.columns(2)
        left.download_button(
            "Trace (JSONL)",
            data=lambda: export.jsonl_bytes(link.store.log()),
            file_name="stepscope-session.jsonl",
            mime="application/jsonl",
            on_click="ignore",
            help="Every recorded protocol message, one JSON object a line.",
        )
        right.download_button(
            "Chrome trace",
            data=lambda: export.chrome_trace_bytes(link.store.log()),
            file_name="stepscope-session.trace.json",
            mime="application/json",
            on_click="ignore",
            help="Open in ui.perfetto.dev: one track per request, one of engine steps.",
        )
