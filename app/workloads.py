"""Workload presets: scripted sequences of protocol commands that make the seed chapter visible
(“Chunked prefill”, *mini-sglang from Scratch*, Stage 2, “Scheduling it well: many requests at
once”).

A preset is data (`Submit`, `SetConfig`, `AwaitTokens`); `PresetRun` plays one in a background
thread through the engine link, so the page stays responsive while it waits for tokens.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from app import controls
from app.state import EventStore, Message

_LIVE = frozenset({"waiting", "running"})
_RUNS = itertools.count(1)
PROMPT_PRESET = "prompt"  # the key of the page's own prompt played as a preset
ENGINE_WAIT_S = 900.0  # a first start converts the model; that can take minutes


@dataclass(frozen=True)
class Submit:
    prompt: str
    max_tokens: int = 64
    chat: bool = False
    ignore_eos: bool = False
    temperature: float = 0.0
    # Starts the prompt with the run's tag, so that playing the preset again (say, under the
    # other policy) is not served from the prefix cache and really chunks the prompt again.
    fresh: bool = False

    def command(self, run_tag: str = "") -> Message:
        prompt = f"({run_tag}) {self.prompt}" if self.fresh and run_tag else self.prompt
        return controls.submit(
            prompt, self.max_tokens, self.temperature, self.chat, self.ignore_eos
        )


@dataclass(frozen=True)
class SetConfig:
    max_extend_tokens: int | None = None
    policy: str | None = None
    admission: str | None = None

    def command(self) -> Message:
        return controls.set_config(self.max_extend_tokens, self.policy, self.admission)


@dataclass(frozen=True)
class AwaitTokens:
    """Wait until each request this preset submitted so far has `tokens` outputs (or ended)."""

    tokens: int
    timeout_s: float = 60.0


Action = Submit | SetConfig | AwaitTokens


@dataclass(frozen=True)
class Preset:
    key: str
    title: str
    help: str
    actions: tuple[Action, ...]


def _long_story(sentences: int) -> str:
    # Varied, deterministic prose: about 39 tokens a sentence with the SmolLM2 tokenizer.
    boats = ("the Marguerite", "the Saint Anne", "the little Heron", "the Northern Star")
    winds = ("a west wind", "a cold north wind", "no wind at all", "a warm southerly breeze")
    catch = ("mackerel", "sardines", "two crabs and an old boot", "nothing but seaweed")
    out = []
    for i in range(sentences):
        out.append(
            f"On day {i + 1}, the old fisherman took {boats[i % 4]} out under {winds[(i // 4) % 4]}"
            f" and came back with {catch[(i * 3) % 4]}, which he counted {i % 7 + 2} times "
            f"before telling the harbour master."
        )
    return " ".join(out)


LONG_PROMPT = _long_story(38) + "\n\nSummarize the fisherman's month in one sentence:"
SYSTEM_PROMPT = (
    "System: You are the harbour's information desk. You answer questions from visitors about "
    "the village, its boats, its weather and its history. "
    + _long_story(12)
    + " Keep every answer short and friendly.\n"
)
CHAT_PROMPTS = (
    "Tell me a short story about a lighthouse keeper.",
    "Explain how a sailboat can sail against the wind.",
    "Write a poem about the sea at night.",
    "Describe a busy fish market in the morning.",
)
SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What do bees make?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Which planet is closest to the sun?",
    "What language is spoken in Spain?",
    "What is frozen water called?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
)
VISITOR_QUESTIONS = (
    "When does the fish market open?",
    "Which boat is the oldest?",
    "Is it safe to swim today?",
    "Where can I buy sardines?",
    "Who is the harbour master?",
)
CHAPTER_PROMPTS = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 3,
    "1 + 1 =",
    "The capital of France is",
)

PRESETS: tuple[Preset, ...] = (
    Preset(
        "stall",
        "Long prompt vs. chatting requests",
        "Four chats start decoding, then a ~1,500-token prompt arrives. Under prefill-first "
        "their decoding stalls while it is chunked; under mixed it does not.",
        (
            *(Submit(p, max_tokens=96, chat=True, ignore_eos=True) for p in CHAT_PROMPTS),
            AwaitTokens(8),
            Submit(LONG_PROMPT, max_tokens=16, fresh=True),
        ),
    ),
    Preset(
        "burst",
        "Burst of short prompts",
        "Twelve short chat questions at once: watch the batch fill and the KV pool grow.",
        tuple(Submit(q, max_tokens=32, chat=True) for q in SHORT_QUESTIONS),
    ),
    Preset(
        "shared",
        "Shared system prompt",
        "One long system prompt, five different questions. After the first, the prefix cache "
        "serves the shared part: short prompt chunks and cached KV pages.",
        (
            Submit(SYSTEM_PROMPT + f"User: {VISITOR_QUESTIONS[0]}\nAssistant:", max_tokens=24),
            AwaitTokens(1),
            *(
                Submit(SYSTEM_PROMPT + f"User: {q}\nAssistant:", max_tokens=24)
                for q in VISITOR_QUESTIONS[1:]
            ),
        ),
    ),
    Preset(
        "pressure",
        "KV pressure",
        "Sixteen long answers (160 tokens each) at once, for a small KV pool: start the engine "
        "with STEPSCOPE_ENGINE_ARGS='--num-pages 640'. Under reserve admission each request is "
        "promised all 160 output pages, so three or four run at a time, the rest wait "
        "(reason: reserved) and the pool never fills. Under optimistic admission more run at "
        "once, the pool hits full, and requests are retracted (red markers) and recomputed "
        "later: more tokens per second, but the retracted ones wait longer.",
        tuple(
            Submit(p, max_tokens=160, chat=True, ignore_eos=True, fresh=True)
            for p in (*CHAT_PROMPTS, *SHORT_QUESTIONS)
        ),
    ),
    Preset(
        "chapter",
        "The chapter's example",
        "Budget 16, prefill-first, and the three prompts of " + controls.CHAPTER + " "
        "(max_tokens=3): a 58-token prompt cut into 16-token chunks, the next request chunked "
        "behind it.",
        (
            SetConfig(max_extend_tokens=16, policy="prefill_first"),
            *(Submit(p, max_tokens=3, ignore_eos=True) for p in CHAPTER_PROMPTS),
        ),
    ),
)
PRESETS_BY_KEY = {p.key: p for p in PRESETS}


def prompt_preset(commands: list[Message]) -> Preset:
    """The page's own prompt (and its copies) as a preset, so it can wait for the engine."""
    first = commands[0]
    return Preset(
        PROMPT_PRESET,
        "Your prompt" + (f" ×{len(commands)}" if len(commands) > 1 else ""),
        first["prompt"][:80],
        tuple(
            Submit(
                c["prompt"],
                max_tokens=c["max_tokens"],
                chat=c["chat"],
                ignore_eos=c["ignore_eos"],
                temperature=c["temperature"],
            )
            for c in commands
        ),
    )


class Sender(Protocol):
    store: EventStore

    def request(self, command: Message, timeout: float = 3.0) -> Message | None: ...

    def status(self) -> Any: ...  # `.state == "connected"` once the engine answers


@dataclass
class PresetRun:
    """One play of a preset: what has been sent, the uids it got, and any refusals."""

    preset: Preset
    uids: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    done_actions: int = 0
    finished: bool = False
    waiting_for: str | None = None
    tag: str = field(default_factory=lambda: f"run {next(_RUNS)} {uuid.uuid4().hex[:6]}")

    def start(self, link: Sender) -> PresetRun:
        threading.Thread(target=self._play, args=(link,), daemon=True).start()
        return self

    def _play(self, link: Sender) -> None:
        try:
            self._await_engine(link)
            for action in self.preset.actions:
                if isinstance(action, AwaitTokens):
                    self._await(link.store, action)
                elif isinstance(action, Submit):
                    self._send(link, action.command(self.tag))
                else:
                    self._send(link, action.command())
                self.done_actions += 1
        except Exception as exc:  # the thread must report, not die silently
            self.errors.append(str(exc))
        finally:
            self.waiting_for = None
            self.finished = True

    def _send(self, link: Sender, command: Message) -> None:
        ok, text = controls.describe_reply(reply := link.request(command))
        if not ok:
            self.errors.append(text)
        elif reply is not None and reply.get("type") == "accepted":
            self.uids.append(int(reply["uid"]))

    def _await_engine(self, link: Sender) -> None:
        """Before the engine is up (it may still be loading): wait, saying so, then send."""
        if link.status().state == "connected":
            return
        self.waiting_for = "held until the engine is connected"
        deadline = time.monotonic() + ENGINE_WAIT_S
        while link.status().state != "connected":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not come up within {ENGINE_WAIT_S:.0f} s")
            time.sleep(0.1)
        self.waiting_for = None

    def _await(self, store: EventStore, action: AwaitTokens) -> None:
        self.waiting_for = f"waiting for {action.tokens} token(s) from each request"
        deadline = time.monotonic() + action.timeout_s
        mine = set(self.uids)
        recs: dict[int, Message] = {}
        cursor = None
        while time.monotonic() < deadline:
            # Only the records that changed since the last look: never the whole history.
            delta = store.delta(cursor, metrics=False)
            cursor = delta.cursor
            recs.update((int(r["uid"]), r) for r in delta.requests if int(r["uid"]) in mine)
            if all(
                (r := recs.get(uid)) is not None
                and (r.get("output_len", 0) >= action.tokens or r.get("state") not in _LIVE)
                for uid in mine
            ):
                return
            time.sleep(0.05)
        self.errors.append(f"gave up waiting for tokens after {action.timeout_s:.0f} s")
