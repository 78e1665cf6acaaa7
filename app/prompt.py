"""The prompt form: type a prompt, submit it (or several copies) to the engine the page shows.

The number fields carry no limits of their own: a browser-side limit blocks Submit with only a
small red mark, so every value reaches `controls.submit`, and a bad one is refused with a message
on the status line. To a stepscope engine a prompt goes over the protocol (held while the
engine is still starting); to a watched SGLang or vLLM, to its OpenAI endpoint.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from app import controls, external, session, workloads
from app.client import EngineLink

HELD = "The engine is starting: your prompt is held and sent once it is up."


def form(link: EngineLink, mode: external.ExternalMode) -> None:
    """The form, and what its Submit does."""
    if not mode.can_submit:
        st.info("Submitting prompts: " + mode.disabled_note(), icon=":material/block:")
        return
    if mode.external:
        st.caption(
            f"Prompts go to the engine's OpenAI endpoint {mode.openai_url} over HTTP; their steps "
            "show here as the engine reports them."
        )
    with st.form("prompt", border=True):
        text = st.text_area(
            "Prompt",
            key=session.PROMPT_TEXT.key,
            height=80,
            placeholder="Type a prompt, or pick a workload in the sidebar…",
        )
        c = st.columns([1, 1, 1, 1, 1, 1.2])
        max_tokens = _number(c[0], "max_tokens", session.MAX_TOKENS, 1)
        temperature = _number(c[1], "temperature", session.TEMPERATURE, 0.1, "0: greedy.")
        copies = _number(c[2], "copies", session.COPIES, 1, f"1 to {controls.MAX_COPIES}.")
        chat = c[3].toggle("chat template", value=True, key=session.CHAT.key)
        ignore_eos = c[4].toggle("ignore EOS", value=False, key=session.IGNORE_EOS.key)
        submitted = c[5].form_submit_button("Submit", type="primary", width="stretch")
    if submitted:
        submit(link, mode, text or "", max_tokens, temperature, copies, chat, ignore_eos)


def _number(
    col: Any, label: str, field: session.Field, step: float, help: str | None = None
) -> Any:
    return col.number_input(label, value=field.default(), step=step, key=field.key, help=help)


def submit(
    link: EngineLink,
    mode: external.ExternalMode,
    text: str,
    max_tokens: float | None,
    temperature: float | None,
    copies: float | None,
    chat: bool,
    ignore_eos: bool,
) -> None:
    """Validate the form's values and send the prompt; every outcome becomes a notice."""
    try:
        if max_tokens is None or temperature is None or copies is None:
            raise ValueError("max_tokens, temperature and copies need a value.")
        command = controls.submit(text, max_tokens, float(temperature), chat, ignore_eos)
        commands = controls.submit_copies(command, copies)
    except ValueError as exc:
        session.notify(False, str(exc))
        return
    if mode.external:
        _post(mode, command, len(commands))
    elif link.status().state != "connected":
        # The first minute: the engine is still loading. Hold the prompt and send it the moment
        # the engine is up, rather than refusing it.
        run = workloads.PresetRun(workloads.prompt_preset(commands)).start(link)
        session.hold(run, HELD)
    else:
        session.submit_now(link, commands)


def _post(mode: external.ExternalMode, command: dict, copies: int) -> None:
    """A watched engine with an OpenAI endpoint: post the prompt there (a thread per copy)."""
    assert mode.openai_url is not None
    posts = session.OPENAI_SUBMITS.setdefault()
    for _ in range(copies):
        request = external.openai_request(
            mode.openai_url,
            str(command["prompt"]),
            int(command["max_tokens"]),
            float(command.get("temperature") or 0.0),
            bool(command.get("chat")),
            mode.model,
        )
        posts.append(external.OpenAISubmit(request).start())
    del posts[:-20]
    session.notify(True, f"sent {copies} prompt(s) to {mode.openai_url} (OpenAI API)")
