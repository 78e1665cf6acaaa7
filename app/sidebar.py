"""The sidebar: engine status, scheduling controls, workload presets, view and session tools.

Controls act through callbacks, which run before the script and send protocol commands; the
sidebar then shows the engine's config, so a change made elsewhere (a preset, another tab) shows.
"""

from __future__ import annotations

import streamlit as st

from app import controls, export, session, workloads
from app.client import EngineLink

REFRESH_S = 1.0
DEFAULT_BUDGET = 256


class Target:
    """The engine URL shared by every tab of the app process (a cached resource holds it)."""

    def __init__(self, url: str) -> None:
        self.url = url


def _on_url(target: Target) -> None:
    target.url = str(st.session_state["url"]).strip()


# ---- callbacks (run before the script, so widget state can still be changed) -----------------


def _apply_config(link: EngineLink, **fields: object) -> None:
    try:
        command = controls.set_config(**fields)  # type: ignore[arg-type]
    except ValueError as exc:
        session.notify(False, str(exc))
        return
    reply = session.send(link, command, "set_config")
    if reply is not None and reply.get("type") == "config":
        st.session_state["synced_config"] = {
            "max_extend_tokens": reply.get("max_extend_tokens"),
            "policy": reply.get("policy"),
        }


def _on_budget_slider(link: EngineLink) -> None:
    value = int(st.session_state["budget_slider"])
    st.session_state["budget_exact"] = value
    _apply_config(link, max_extend_tokens=value)


def _on_budget_exact(link: EngineLink) -> None:
    value = int(st.session_state["budget_exact"])
    st.session_state["budget_slider"] = value
    _apply_config(link, max_extend_tokens=value)


def _on_policy(link: EngineLink) -> None:
    _apply_config(link, policy=st.session_state["policy"])


def _start_preset(link: EngineLink, preset: workloads.Preset) -> None:
    runs = st.session_state.setdefault("preset_runs", [])
    runs.append(workloads.PresetRun(preset).start(link))
    del runs[:-3]
    session.notify(True, f"workload “{preset.title}” started")


def _clear(link: EngineLink) -> None:
    link.store.clear()
    st.session_state["frozen"] = link.store.snapshot() if not session.is_live() else None
    st.session_state.pop("inspect", None)
    session.notify(True, "history cleared (the engine keeps running)")


# ---- sidebar ----------------------------------------------------------------------------------


def _sync_controls(config: dict | None) -> None:
    """Make the controls show the engine's config when it changed elsewhere (preset, other tab)."""
    ss = st.session_state
    ss.setdefault("budget_exact", DEFAULT_BUDGET)
    ss.setdefault("budget_slider", ss["budget_exact"])
    ss.setdefault("policy", controls.POLICIES[0])
    if config and config.get("max_extend_tokens") and ss.get("synced_config") != config:
        ss["synced_config"] = dict(config)
        ss["budget_exact"] = ss["budget_slider"] = int(config["max_extend_tokens"])
        if config.get("policy") in controls.POLICIES:
            ss["policy"] = config["policy"]


def connection_badge(link: EngineLink) -> None:
    status = link.status()
    engine = link.store.snapshot(last_steps=0).engine or {}
    if status.state == "connected":
        st.markdown(":green[●] **connected**")
        if engine:
            st.caption(
                f"{engine.get('model', '?')} · {engine.get('device', '?')} · "
                f"{engine.get('dtype', '?')}  \n{engine.get('num_pages', 0):,} pages × "
                f"{engine.get('page_size', 1)} token · {engine.get('cache_type', 'prefix')} cache"
                + (" · overlapped steps" if engine.get("overlap") else "")
                + (" · batch-invariant" if engine.get("batch_invariant") else "")
            )
    elif status.state == "connecting":
        st.markdown(":orange[●] **connecting…**")
    else:
        st.markdown(":red[●] **not connected**")


def render(link: EngineLink | None, target: Target) -> None:
    with st.sidebar:
        st.subheader("Engine")
        st.text_input(
            "Engine URL",
            key="url",
            on_change=_on_url,
            args=(target,),
            help="A stepscope engine server (PROTOCOL.md); every tab of this app follows it.",
        )
        if link is None:
            return
        st.fragment(connection_badge, run_every=REFRESH_S * 2)(link)

        st.subheader("Scheduling")
        _sync_controls(link.store.snapshot(last_steps=0).config)
        left, right = st.columns([3, 1.3])
        left.select_slider(
            "max_extend_tokens",
            options=controls.budget_options(st.session_state["budget_exact"]),
            key="budget_slider",
            on_change=_on_budget_slider,
            args=(link,),
            help="Prompt tokens per step (the chunk size). Applies from the next step.",
        )
        right.number_input(
            "exact",
            min_value=1,
            step=1,
            key="budget_exact",
            on_change=_on_budget_exact,
            args=(link,),
            help="Any exact budget ≥ 1.",
        )
        st.radio(
            "Policy",
            controls.POLICIES,
            format_func=controls.POLICY_LABELS.__getitem__,
            key="policy",
            on_change=_on_policy,
            args=(link,),
            captions=[
                "one kind per step: decode waits while a prompt is chunked",
                "decodes ride along in every step; prompts get the rest",
            ],
        )

        st.subheader("Workloads")
        for preset in workloads.PRESETS:
            st.button(
                preset.title,
                key=f"preset-{preset.key}",
                help=preset.help,
                on_click=_start_preset,
                args=(link, preset),
                width="stretch",
            )

        st.subheader("View")
        st.session_state.setdefault("live", True)
        st.toggle(
            "Live",
            key="live",
            on_change=session.freeze,
            args=(link,),
            help="Pause to freeze the charts: zoom and hover without updates undoing it.",
        )
        st.session_state.setdefault("window", session.DEFAULT_WINDOW)
        st.select_slider("Steps in view", options=session.WINDOWS, key="window")
        st.radio("x axis", ("step", "time"), key="xmode", horizontal=True)

        st.subheader("Session")
        st.button("Clear history", on_click=_clear, args=(link,), width="stretch")
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
