"""IncrementalDetokenizer: the text each new token adds, without re-decoding the whole output.

A token can end inside a multi-byte character; its text is held back until the character is
complete (the decoder shows U+FFFD until then).
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # decoding restarts here, a few tokens back, to keep spacing right
        self.read_offset = 0  # text up to here has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip
        )
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
