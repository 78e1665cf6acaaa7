"""Protocol commands built from what the user set on the page, validated before they go out.

Pure functions: the page calls them and shows a `ValueError`'s message; the engine validates
again and may still answer with an `error`, which the page shows too.
"""

from __future__ import annotations

from typing import Any

from instrumentation.protocol import ADMISSION_MODES as ADMISSIONS
from instrumentation.protocol import POLICY_NAMES as POLICIES

# The seed chapter the page makes visible, named wherever the page cites it.
CHAPTER = (
    "“Chunked prefill”, *mini-sglang from Scratch*, Stage 2 "
    "(“Scheduling it well: many requests at once”)"
)
POLICY_LABELS = {
    "prefill_first": "prefill-first (the chapter's)",
    "mixed": "mixed (stall-free)",
}
ADMISSION_LABELS = {
    "reserve": "reserve (the chapter's)",
    "optimistic": "optimistic (SGLang's)",
}
# why the head of the waiting queue was not admitted (a step's `queue.waiting_reason`)
WAIT_REASON_TEXT = {
    "budget": "budget: this step's prompt tokens are spent",
    "kv": "kv: not enough free or evictable KV pages",
    "max_running": "max_running: every running slot is taken",
    "reserved": "reserved: pages are free but promised to admitted requests",
}
BUDGET_STEPS = tuple(2**k for k in range(14))  # 1, 2, 4, ... 8192
MAX_COPIES = 64

Command = dict[str, Any]


def budget_options(current: int | None = None) -> list[int]:
    """Slider stops: powers of two, plus the exact current value so the slider can show it."""
    stops = set(BUDGET_STEPS)
    if current is not None and current >= 1:
        stops.add(int(current))
    return sorted(stops)


def parse_budget(text: str) -> int:
    """The exact-budget box's text as a budget: a whole number ≥ 1, else a ValueError that says
    what was typed (an empty box or letters are refused, never read as 1)."""
    try:
        value = int(text.strip().replace(",", "").replace("_", ""))
    except ValueError:
        raise ValueError(
            f"max_extend_tokens must be a whole number ≥ 1, not {text.strip()!r}: "
            "the budget is unchanged."
        ) from None
    if value < 1:
        raise ValueError(f"max_extend_tokens must be ≥ 1, not {value}: the budget is unchanged.")
    return value


def set_config(
    max_extend_tokens: int | None = None, policy: str | None = None, admission: str | None = None
) -> Command:
    cmd: Command = {"type": "set_config"}
    if admission is not None:
        if admission not in ADMISSIONS:
            raise ValueError(
                f"Unknown admission {admission!r}; choose one of {', '.join(ADMISSIONS)}."
            )
        cmd["admission"] = admission
    if max_extend_tokens is not None:
        if int(max_extend_tokens) != max_extend_tokens or max_extend_tokens < 1:
            raise ValueError("max_extend_tokens must be a whole number ≥ 1.")
        cmd["max_extend_tokens"] = int(max_extend_tokens)
    if policy is not None:
        if policy not in POLICIES:
            raise ValueError(f"Unknown policy {policy!r}; choose one of {', '.join(POLICIES)}.")
        cmd["policy"] = policy
    return cmd


def submit(
    prompt: str,
    max_tokens: int = 64,
    temperature: float = 0.0,
    chat: bool = False,
    ignore_eos: bool = False,
) -> Command:
    if not prompt or not prompt.strip():
        raise ValueError("The prompt is empty: type some text to submit.")
    if int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError("max_tokens must be a whole number ≥ 1.")
    if temperature < 0:
        raise ValueError("temperature must be ≥ 0 (0 means greedy).")
    return {
        "type": "submit",
        "prompt": prompt,
        "max_tokens": int(max_tokens),
        "temperature": float(temperature),
        "chat": bool(chat),
        "ignore_eos": bool(ignore_eos),
    }


def submit_copies(command: Command, copies: int) -> list[Command]:
    if int(copies) != copies or not 1 <= copies <= MAX_COPIES:
        raise ValueError(f"copies must be between 1 and {MAX_COPIES}.")
    return [dict(command) for _ in range(int(copies))]


def abort(uid: int) -> Command:
    return {"type": "abort", "uid": int(uid)}


def kv_map() -> Command:
    """Ask for the pool page by page (the engine's `kv_map` extension, docs/protocol.md)."""
    return {"type": "kv_map"}


def describe_reply(
    reply: dict[str, Any] | None, command: dict[str, Any] | None = None
) -> tuple[bool, str]:
    """(ok, text) for an engine reply to `command`, for a status line."""
    if reply is None:
        return False, "No reply from the engine within 3 s (the command may still apply)."
    kind = reply.get("type")
    if kind == "accepted" and (command or {}).get("type") == "abort":
        return True, f"request {reply.get('uid')} aborted; its pages are returned"
    if kind == "accepted":
        return True, f"accepted as request {reply.get('uid')}"
    if kind == "config":
        return True, (
            f"engine now runs max_extend_tokens={reply.get('max_extend_tokens')}, "
            f"policy={reply.get('policy')}"
            + (f", admission={reply['admission']}" if reply.get("admission") else "")
        )
    if kind == "error":
        return False, f"the engine refused it ({reply.get('code')}): {reply.get('message')}"
    return False, f"unexpected reply: {reply}"
