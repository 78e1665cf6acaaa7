"""The sidebar: engine status, scheduling controls, workload presets, view and session tools.

Controls act through callbacks, which run before the script and send protocol commands; the
sidebar then shows the engine's config, so a change made elsewhere (a preset, another tab) shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import streamlit as st

from app import controls, export, session, workloads
from app.client import EngineLink
from app.external import ExternalMode

REFRESH_S = 1.0
DEFAULT_BUDGET = session.DEFAULT_BUDGET
STALE_S = 3.0  # how long a value from before a sync may still come back from the browser
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
        synced = {
            "max_extend_tokens": reply.get("max_extend_tokens"),
            "policy": reply.get("policy"),
            "admission": reply.get("admission"),
        }
        session.SYNCED_CONFIG.set(synced)
        # what this tab set, newest last: the store may still show an older one of them for a
        # moment (it folds the broadcasts on another thread), which must not undo a newer press
        mine = session.OWN_CONFIGS.setdefault()
        mine.append((synced, time.monotonic()))
        del mine[:-8]


def _stale(field: str, value: object) -> bool:
    """A value the controls showed before they were synced to the engine's config, sent back by
    a rerun the browser started before the sync reached it (the live charts rerun their
    fragment several times a second). It is not the user's choice: put the synced one back."""
    old = session.STALE[field].get()
    if old is None or old[0] != value or time.monotonic() - old[1] > STALE_S:
        return False
    synced = session.SYNCED_CONFIG.get() or {}
    if field == "max_extend_tokens":
        session.BUDGET_EXACT.set(synced[field])
        session.BUDGET_SLIDER.set(synced[field])
    elif field == "admission":
        session.ADMISSION.set(synced[field])
    else:
        session.POLICY.set(synced[field])
    return True


def _on_budget_slider(link: EngineLink) -> None:
    value = int(session.BUDGET_SLIDER.get())
    if _stale("max_extend_tokens", value):
        return
    session.BUDGET_EXACT.set(value)
    _apply_config(link, max_extend_tokens=value)


def _on_budget_exact(link: EngineLink) -> None:
    value = int(session.BUDGET_EXACT.get())
    if _stale("max_extend_tokens", value):
        return
    session.BUDGET_SLIDER.set(value)
    _apply_config(link, max_extend_tokens=value)


def _on_policy(link: EngineLink) -> None:
    if _stale("policy", session.POLICY.get()):
        return
    _apply_config(link, policy=session.POLICY.get())


def _on_admission(link: EngineLink) -> None:
    if _stale("admission", session.ADMISSION.get()):
        return
    _apply_config(link, admission=session.ADMISSION.get())


def _start_preset(link: EngineLink, preset: workloads.Preset) -> None:
    run = workloads.PresetRun(preset).start(link)
    if link.status().state == "connected":
        session.add_run(run)
        session.notify(True, f"workload “{preset.title}” started")
    else:
        session.hold(run, f"workload “{preset.title}” held: it starts once the engine is up")


def _clear(link: EngineLink) -> None:
    link.store.clear()
    session.FROZEN.set(link.store.snapshot() if not session.is_live() else None)
    session.notify(True, "history cleared (the engine keeps running)")


# ---- sidebar ----------------------------------------------------------------------------------


def _sync_controls(config: dict | None) -> None:
    """Make the controls show the engine's config when it changed elsewhere (preset, other tab)."""
    exact = session.BUDGET_EXACT.setdefault()
    if not session.BUDGET_SLIDER.present():
        session.BUDGET_SLIDER.set(exact)
    policy = session.POLICY.setdefault()
    admission = session.ADMISSION.setdefault()
    if config and config.get("max_extend_tokens") and session.SYNCED_CONFIG.get() != config:
        if _lagging(config):
            return
        session.SYNCED_CONFIG.set(dict(config))
        now = time.monotonic()
        budget = int(config["max_extend_tokens"])
        if exact != budget:
            session.STALE["max_extend_tokens"].set((exact, now))
        session.BUDGET_EXACT.set(budget)
        session.BUDGET_SLIDER.set(budget)
        if config.get("policy") in controls.POLICIES:
            if policy != config["policy"]:
                session.STALE["policy"].set((policy, now))
            session.POLICY.set(config["policy"])
        if config.get("admission") in controls.ADMISSIONS:
            if admission != config["admission"]:
                session.STALE["admission"].set((admission, now))
            session.ADMISSION.set(config["admission"])


def _lagging(config: dict) -> bool:
    """The engine's config as the store shows it is one this tab set before its latest change,
    and that change is recent: the store has not folded the newer broadcast yet."""
    mine = session.OWN_CONFIGS.get()
    if len(mine) < 2 or time.monotonic() - mine[-1][1] > STALE_S:
        return False
    shown = {k: config.get(k) for k in ("max_extend_tokens", "policy", "admission")}
    return any(shown == cfg for cfg, _ in mine[:-1]) and shown != mine[-1][0]


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


def connection_badge(
    link: EngineLink, outdated: Callable[[EngineLink], bool], replaying: str | None = None
) -> None:
    if outdated(link):  # the engine came up since the page was drawn: draw it whole, once
        st.rerun(scope="app")
    if replaying is not None:  # the page shows a recording: no engine is connected to it
        st.markdown(":gray[●] **no engine** · replaying a recording")
        st.caption("The engine URL is used again once the recording is closed.")
        return
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


def render(
    link: EngineLink | None,
    target: Target,
    mode: ExternalMode = OWN_ENGINE,
    outdated: Callable[[EngineLink], bool] = lambda link: False,
) -> None:
    """The sidebar. `outdated(link)` says the page was drawn before something the full page
    shows (the engine's config, a held prompt sent): the badge's fragment then redraws it."""
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
        session.controls_waiting(waiting and mode.commands)
        st.fragment(connection_badge, run_every=REFRESH_S)(link, outdated, mode.replaying)

        st.subheader("Scheduling")
        if mode.replaying is not None:
            # A recording's budget and policy, as they stood at the step shown: read-only.
            st.caption("Budget and policy: " + mode.disabled_note())
            if config:
                _scheduling_controls(link, config, disabled=True)
        elif mode.external:
            # A watched engine takes no commands: say so instead of showing dead controls.
            st.caption("Budget and policy: " + mode.disabled_note())
        elif waiting:
            # Until the engine says what it runs, controls would show made-up values (and send
            # them): say why they are not there yet.
            st.caption("Engine starting… the scheduling controls appear once it is connected.")
        else:
            _scheduling_controls(link, config)
        _workloads_and_view(link, mode)


def _scheduling_controls(link: EngineLink, config: dict | None, disabled: bool = False) -> None:
    _sync_controls(config)
    left, right = st.columns([3, 1.3])
    left.select_slider(
        "max_extend_tokens",
        options=controls.budget_options(session.BUDGET_EXACT.get()),
        key=session.BUDGET_SLIDER.key,
        on_change=_on_budget_slider,
        args=(link,),
        help="Prompt tokens per step (the chunk size). Applies from the next step.",
        disabled=disabled,
    )
    right.number_input(
        "exact",
        min_value=1,
        step=1,
        key=session.BUDGET_EXACT.key,
        on_change=_on_budget_exact,
        args=(link,),
        help="Any exact budget ≥ 1.",
        disabled=disabled,
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
        disabled=disabled,
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
        "from the next step; admitted requests keep their promise.",
        disabled=disabled,
    )


def _workloads_and_view(link: EngineLink, mode: ExternalMode) -> None:
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
    st.select_slider("Steps in view", options=session.WINDOWS, key=session.WINDOW.key)
    st.radio("x axis", ("step", "time"), key=session.XMODE.key, horizontal=True)

    st.subheader("Session")
    replaying = mode.replaying is not None
    st.button(
        "Clear history",
        key=session.CLEAR.key,
        on_click=_clear,
        args=(link,),
        width="stretch",
        disabled=replaying,
        help=mode.disabled_note() if replaying else "Forget the steps shown (the engine runs on).",
    )
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
