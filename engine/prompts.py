"""A prompt as token ids: text through the tokenizer (or its chat template), or ids checked
against the vocabulary. Torch-free, so the API process tokenizes exactly as `LLM.encode` does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from instrumentation.errors import InvalidRequest, TooLarge


def encode_prompt(tokenizer: Any, prompt: Any, vocab_size: int, chat: bool = False) -> list[int]:
    """`prompt` (a string or a sequence of token ids) as a list of ids; InvalidRequest if bad."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidRequest("the prompt is empty")
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return list(tokenizer.encode(text, add_special_tokens=False))
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise InvalidRequest(
            f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
        )
    if chat:
        raise InvalidRequest("chat=True needs a text prompt, not token ids")
    ids = list(prompt)
    if not ids:
        raise InvalidRequest("the prompt is empty")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"token ids must be integers in [0, {vocab_size}), got {t!r}")
    return ids


def check_fits(
    prompt_len: int, max_tokens: int, *, max_seq_len: int, page_size: int, num_pages: int
) -> None:
    """TooLarge if a prompt plus `max_tokens` could never run: beyond the context or the pool."""
    total = prompt_len + max_tokens
    if total > max_seq_len:
        raise TooLarge(
            f"{prompt_len} prompt tokens plus max_tokens={max_tokens} is {total} tokens, "
            f"beyond max_seq_len={max_seq_len}"
        )
    need = -(-total // page_size)  # pages, rounded up
    if need > num_pages:
        raise TooLarge(f"the request needs {need} KV pages; the whole pool has {num_pages}")
