"""stepscope's dashboard: `streamlit run app/main.py`, then watch an engine schedule, step by step.

The page is a thin protocol client (PROTOCOL.md): one background connection per app process
(`engine_link`, a cached resource) feeds every browser tab; fragments redraw the live parts
every second. If nothing answers at a local URL, the app starts `python -m engine.server`.

Environment: STEPSCOPE_URL (default ws://127.0.0.1:8765), STEPSCOPE_MODEL (default smollm2),
STEPSCOPE_AUTOSTART (0 turns the auto-start off), STEPSCOPE_ENGINE_ARGS (extra server flags).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

# `streamlit run app/main.py` puts app/ on sys.path, not the project root that holds `app`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from app import controls, panels, session, sidebar  # noqa: E402
from app.client import EngineLink, valid_url  # noqa: E402
from app.launcher import Launcher, engine_argv, local_port, should_autostart  # noqa: E402

DEFAULT_URL = os.environ.get("STEPSCOPE_URL", "ws://127.0.0.1:8765")
MODEL = os.environ.get("STEPSCOPE_MODEL", "smollm2")
AUTOSTART = os.environ.get("STEPSCOPE_AUTOSTART", "1") != "0"
ENGINE_ARGS = tuple(shlex.split(os.environ.get("STEPSCOPE_ENGINE_ARGS", "")))
REFRESH_S = sidebar.REFRESH_S


@st.cache_resource(show_spinner=False)
def engine_target() -> sidebar.Target:
    """The URL every tab watches: one per process, like the connection it names."""
    return sidebar.Target(DEFAULT_URL)


def _close_link(link: EngineLink) -> None:
    link.close()


@st.cache_resource(max_entries=1, on_release=_close_link, show_spinner=False)
def engine_link(url: str) -> EngineLink:
    """The process's one connection; changing the URL releases (closes) the previous one."""
    return EngineLink(url).start()


def _stop_launcher(launcher: Launcher) -> None:
    launcher.stop()


@st.cache_resource(on_release=_stop_launcher, show_spinner=False)
def engine_launcher() -> Launcher:
    return Launcher()


def _argv(url: str) -> list[str]:
    return engine_argv(local_port(url) or 8765, MODEL, ENGINE_ARGS)


def _restart_engine(launcher: Launcher, url: str) -> None:
    launcher.restart(_argv(url))


# ---- main area --------------------------------------------------------------------------------


def connection_panel(link: EngineLink, launcher: Launcher) -> None:
    """Loading progress, a lost engine, or a dead one, said plainly, with a way out."""
    url = link.url
    status = link.status()
    proc = launcher.process
    if should_autostart(
        url, status.ever_connected, status.failed_attempts, AUTOSTART, proc is not None
    ):
        proc = launcher.start(_argv(url))
    if status.state == "connected":
        return
    if proc is not None and proc.state == "starting":
        progress = proc.progress
        st.info(f"Starting the engine: `{shlex.join(proc.argv[1:])}` (pid {proc.pid}).")
        if progress is not None:
            st.progress(progress.fraction, text=f"{progress.label}: {progress.fraction:.0%}")
        st.code("\n".join(proc.tail(10)) or "(waiting for its first output)", language="text")
    elif proc is not None and proc.state == "ready":
        st.info(f"The engine is up at {proc.ready_url}; connecting…")
    elif proc is not None and proc.state == "exited":
        st.error(f"The engine process exited with code {proc.returncode}. Its last output:")
        st.code("\n".join(proc.tail(12)) or "(no output)", language="text")
        st.button(
            "Restart the engine",
            type="primary",
            on_click=_restart_engine,
            args=(launcher, url),
            key="restart-engine",
        )
    elif status.state == "connecting":
        st.info(f"Connecting to {url}…")
    else:
        lost = "Lost the engine" if status.ever_connected else "Nothing answers"
        st.warning(f"{lost} at {url}: {status.error} Retrying every second.")
        if local_port(url) is not None:
            st.button(
                f"Start an engine here ({MODEL})",
                on_click=lambda: launcher.start(_argv(url)),
                key="start-engine",
            )


def status_strip(link: EngineLink) -> None:
    snap = session.view_snapshot(link)
    panels.metrics_row(snap)
    for run in st.session_state.get("preset_runs", [])[-2:]:
        total = len(run.preset.actions)
        line = f"Workload “{run.preset.title}”: {run.done_actions}/{total} steps sent"
        if run.uids:
            line += f" · requests {', '.join(map(str, run.uids))}"
        if run.waiting_for:
            line += f" · {run.waiting_for}"
        done = run.finished and not run.errors
        st.caption((":material/check_circle: " if done else ":material/play_circle: ") + line)
        for err in run.errors:
            st.error(f"Workload “{run.preset.title}”: {err}")


def prompt_form(link: EngineLink) -> None:
    with st.form("prompt", border=True):
        text = st.text_area(
            "Prompt",
            key="prompt_text",
            height=80,
            placeholder="Type a prompt, or pick a workload in the sidebar…",
        )
        c = st.columns([1, 1, 1, 1, 1, 1.2])
        max_tokens = c[0].number_input("max_tokens", min_value=1, value=64, key="max_tokens")
        temperature = c[1].number_input(
            "temperature", min_value=0.0, value=0.0, step=0.1, key="temperature", help="0: greedy."
        )
        copies = c[2].number_input(
            "copies", min_value=1, max_value=controls.MAX_COPIES, value=1, key="copies"
        )
        chat = c[3].toggle("chat template", value=True, key="chat")
        ignore_eos = c[4].toggle("ignore EOS", value=False, key="ignore_eos")
        submitted = c[5].form_submit_button("Submit", type="primary", width="stretch")
    if not submitted:
        return
    try:
        command = controls.submit(text or "", int(max_tokens), float(temperature), chat, ignore_eos)
        commands = controls.submit_copies(command, int(copies))
    except ValueError as exc:
        session.notify(False, str(exc))
        return
    ids = []
    for cmd in commands:
        try:
            ids.append(link.send(cmd))
        except RuntimeError as exc:
            session.notify(False, f"submit: {exc}")
            return
    uids, errors = [], []
    for cid in ids:
        ok, msg = controls.describe_reply(reply := link.store.wait_reply(cid, 3.0))
        if ok and reply is not None:
            uids.append(str(reply["uid"]))
        else:
            errors.append(msg)
    if uids:
        session.notify(True, f"submitted: request {', '.join(uids)}")
    for msg in errors:
        session.notify(False, f"submit: {msg}")


def notices_line() -> None:
    for ok, text in st.session_state.pop("unshown_toasts", []):
        st.toast(text, icon=":material/check_circle:" if ok else ":material/error:")
    items = session.notices()
    if not items:
        return
    last = items[-1]
    (st.success if last.ok else st.error)(last.text)


def views(link: EngineLink, launcher: Launcher) -> None:
    snap = session.view_snapshot(link)
    connection_panel(link, launcher)
    if link.status().state != "connected" and not snap.steps:
        return  # the loading progress above is the page until the engine is up
    tabs = st.tabs(["Timeline", "KV cache", "Latency", "Requests"], key="tab", on_change="rerun")
    policy = (snap.config or {}).get("policy")
    if tabs[0].open:
        with tabs[0]:
            panels.timeline_view(snap, policy)
            frozen = st.session_state.get("frozen")
            if not session.is_live() and frozen is not None:
                panels.inspect_slider(frozen)
            panels.outputs_view(snap.requests)
    if tabs[1].open:
        with tabs[1]:
            panels.kv_view(snap)
    if tabs[2].open:
        with tabs[2]:
            panels.latency_view(snap)
    if tabs[3].open:
        with tabs[3]:
            panels.requests_view(link, snap)


def main() -> None:
    st.set_page_config(page_title="stepscope", page_icon="🔭", layout="wide")
    target = engine_target()
    # Another tab may have changed the process's URL: show it here too.
    if st.session_state.get("url") != target.url:
        st.session_state["url"] = target.url
    problem = valid_url(target.url)
    link = None if problem else engine_link(target.url)
    launcher = engine_launcher()
    sidebar.render(link, target)

    st.markdown("## :material/monitoring: stepscope")
    st.caption(
        "An LLM inference engine, step by step: which requests share each batch, where prompts "
        "are cut into chunks, how full the KV cache is, and when decoding stalls."
    )
    if link is None:
        st.error(problem or "No engine URL.")
        return
    every = REFRESH_S if session.is_live() else None
    if not session.is_live():
        st.info("Paused: the charts are frozen so you can zoom and hover. Switch Live back on.")
    st.fragment(status_strip, run_every=every)(link)
    prompt_form(link)
    notices_line()
    st.fragment(views, run_every=every)(link, launcher)


main()
