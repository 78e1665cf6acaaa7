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

    @property
    def commands(self) -> bool:
        """Whether stepscope commands (submit, config, abort) reach the engine."""
        return not self.external

    @property
    def can_submit(self) -> bool:
        return not self.external or self.openai_url is not None

    def disabled_note(self) -> str:
        """The sentence shown beside the disabled controls."""
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


# ---- a watched engine's page: data-parallel ranks, honest times, KV events ----

ALL_RANKS = "all ranks"
PHASE_COLORS = {"prefill": "#999", "decode": "#555", "mixed": "#4c78a8"}
ESTIMATED_NOTE = (
    "Step times are estimated: the engine's log stamps whole seconds, so the steps of each second "
    "are laid out inside it by their order and elapsed times (docs/watch.md: millisecond stamps)."
)
RECEIVED_NOTE = "Step times are when the watch read them: the source carries no timestamps."


def dp_ranks(
    steps: Sequence[Mapping[str, Any]], kv_events: Sequence[Mapping[str, Any]] = ()
) -> list[int]:
    """The data-parallel ranks the steps and KV events name: each is an engine of its own."""
    found = {m.get("dp_rank") for m in (*steps, *kv_events)}
    return sorted(r for r in found if isinstance(r, int))


def of_rank(messages: Sequence[dict[str, Any]], rank: int | None) -> list[dict[str, Any]]:
    """The messages of one rank (all of them for None)."""
    return list(messages) if rank is None else [m for m in messages if m.get("dp_rank") == rank]


def time_note(steps: Sequence[Mapping[str, Any]]) -> str | None:
    sources = {s.get("t_source") for s in steps}
    if "estimated" in sources:
        return ESTIMATED_NOTE
    return RECEIVED_NOTE if "received" in sources else None


def kv_gap_note(kv_events: Sequence[Mapping[str, Any]]) -> str | None:
    """What the page says when KV-event batches were missed and not recovered by replay."""
    lost = sum(int((m.get("gap") or {}).get("lost") or 0) for m in kv_events)
    if not lost:
        return None
    batches = "batch was" if lost == 1 else "batches were"
    return (
        f"{lost:,} KV-event {batches} missed and could not be recovered (no replay socket, "
        "or the engine no longer held them): the blocks held may be off."
    )


def _lane(rank: int | None) -> str:
    return "engine" if rank is None else f"DP rank {rank}"


def rank_lanes_figure(steps: Sequence[Mapping[str, Any]], x: str = "time") -> Any:
    """One lane per data-parallel rank: each step a bar from t0 to t1 (or one step wide on the
    step axis), coloured by phase, so the ranks' schedules sit side by side."""
    import plotly.graph_objects as go

    lanes = [_lane(r) for r in ([None] if not dp_ranks(steps) else dp_ranks(steps))]
    data = []
    for phase, color in PHASE_COLORS.items():
        rows = [s for s in steps if s.get("phase") == phase]
        if not rows:
            continue
        if x == "time":
            base = [float(s["t0"]) for s in rows]
            width = [max(float(s["t1"]) - float(s["t0"]), 1e-3) for s in rows]
        else:
            base = [int(s["step"]) - 0.45 for s in rows]
            width = [0.9] * len(rows)
        hover = [
            f"{_lane(s.get('dp_rank'))} · step {s['step']}"
            + (f" · iteration {s['iteration']}" if "iteration" in s else "")
            + f"<br>{phase} · {s.get('prompt_tokens') or 0:,} prompt tokens · "
            f"{s.get('decode_requests') or 0} decoding"
            + (f"<br>{float(s['t1']) - float(s['t0']):.3f} s ({s.get('t_source')})")
            for s in rows
        ]
        data.append(
            go.Bar(
                name=phase, orientation="h", base=base, x=width,
                y=[_lane(s.get("dp_rank")) for s in rows], marker={"color": color},
                hovertext=hover, hoverinfo="text",
            )
        )  # fmt: skip
    layout = {
        "height": 120 + 40 * len(lanes),
        "barmode": "overlay",
        "margin": {"l": 90, "r": 20, "t": 30, "b": 40},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        "xaxis": {"title": {"text": "engine time (s)" if x == "time" else "engine step"}},
        "yaxis": {"categoryorder": "array", "categoryarray": lanes[::-1]},
        "uirevision": "stepscope-rank-lanes",
    }
    return go.Figure(data=data, layout=layout)


def kv_hit_rate_figure(kv_events: Sequence[dict[str, Any]]) -> Any | None:
    """The prefix-cache hit rate the KV events report, after each batch; None when no batch
    reported a reuse (then the events say nothing of hits)."""
    import plotly.graph_objects as go

    from instrumentation.watch.kv_events import running_hit_rate

    rates = running_hit_rate(list(kv_events))
    if all(r is None for r in rates):
        return None
    xs = [float(m.get("t", 0.0)) for m in kv_events]
    reused = [int(m.get("reused_blocks") or 0) for m in kv_events]
    hover = [
        f"hit rate so far {r:.0%}<br>this batch: {u} blocks reused, {m.get('stored_blocks', 0)} "
        "stored"
        if r is not None
        else "no reuse reported yet"
        for r, u, m in zip(rates, reused, kv_events, strict=True)
    ]
    pct = [None if r is None else 100 * r for r in rates]
    trace = go.Scatter(
        name="prefix-cache hit rate (blocks)", x=xs, y=pct, mode="lines+markers",
        line={"shape": "hv", "color": "#59a14f"}, hovertext=hover, hoverinfo="text",
    )  # fmt: skip
    layout = {
        "height": 220,
        "margin": {"l": 60, "r": 20, "t": 30, "b": 40},
        "xaxis": {"title": {"text": "time (s)"}},
        "yaxis": {"title": {"text": "hit rate %"}, "range": [0, 100]},
        "uirevision": "stepscope-kv-hit-rate",
        "showlegend": True,
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
    }
    return go.Figure(data=[trace], layout=layout)
