"""The page watching an external engine (hello.engine.external, from instrumentation.watch).

Such an engine takes no stepscope commands: submit, budget, policy, workloads and abort are
disabled with the watch's reason, unless the page knows the engine's OpenAI endpoint (the
watch's `--openai-url`, or the app's own `--openai-url` / STEPSCOPE_OPENAI_URL), in which case
the prompt form posts to `{url}/v1/completions` (or `/v1/chat/completions`) over plain HTTP.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OPENAI_TIMEOUT_S = 120.0
DEFAULT_REASON = "this engine is watched from its output and takes no commands"


@dataclass(frozen=True)
class ExternalMode:
    """What the page may do with the engine it shows."""

    external: bool
    reason: str = ""
    openai_url: str | None = None
    source: str | None = None
    model: str | None = None  # sent as the OpenAI request's `model` when the engine named it
    replaying: str | None = None  # a recording's name: the page shows it, no engine is there

    @property
    def commands(self) -> bool:
        """Whether stepscope commands (submit, config, abort) reach the engine."""
        return not self.external and self.replaying is None

    @property
    def can_submit(self) -> bool:
        return self.replaying is None and (not self.external or self.openai_url is not None)

    def disabled_note(self) -> str:
        """The sentence shown beside the disabled controls."""
        if self.replaying is not None:
            return (
                f"Unavailable (replaying {self.replaying}): a recording is shown, "
                "the engine cannot be commanded."
            )
        what = f"watching {self.source}" if self.source else "watching an external engine"
        return f"Unavailable ({what}): {self.reason}."


def openai_url_from(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """`streamlit run app/main.py -- --openai-url URL` wins over STEPSCOPE_OPENAI_URL."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--openai-url" and i + 1 < len(args):
            return args[i + 1].rstrip("/")
        if arg.startswith("--openai-url="):
            return arg.split("=", 1)[1].rstrip("/")
    url = environ.get("STEPSCOPE_OPENAI_URL", "").strip()
    return url.rstrip("/") or None


def external_mode(engine: Mapping[str, Any] | None, openai_url: str | None = None) -> ExternalMode:
    """The page's mode from hello.engine; the app's own OpenAI URL takes precedence."""
    engine = engine or {}
    if not engine.get("external"):
        return ExternalMode(False)
    url = openai_url or engine.get("openai_url")
    return ExternalMode(
        True,
        reason=str(engine.get("commands_reason") or DEFAULT_REASON),
        openai_url=str(url).rstrip("/") if url else None,
        source=engine.get("source"),
        model=engine.get("model"),
    )


def openai_request(
    base_url: str, prompt: str, max_tokens: int, temperature: float, chat: bool, model: str | None
) -> urllib.request.Request:
    """The POST for one prompt (streaming is not needed: the steps show on the charts)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
    if model:
        body["model"] = model
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    return urllib.request.Request(
        base_url.rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )


def completion_text(reply: Mapping[str, Any]) -> str:
    choice = (reply.get("choices") or [{}])[0]
    if "message" in choice:
        return str((choice.get("message") or {}).get("content") or "")
    return str(choice.get("text") or "")


@dataclass
class OpenAISubmit:
    """One prompt posted in a background thread; the page reads `done`, `text`, `error`."""

    request: urllib.request.Request
    done: bool = False
    text: str = ""
    error: str | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> OpenAISubmit:
        self._thread = threading.Thread(target=self._run, name="openai-submit", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done

    def _run(self) -> None:
        try:
            with urllib.request.urlopen(self.request, timeout=OPENAI_TIMEOUT_S) as response:
                self.text = completion_text(json.loads(response.read()))
        except Exception as exc:  # noqa: BLE001 - any failure is shown on the page
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done = True
