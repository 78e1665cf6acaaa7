"""IncrementalDetokenizer: the text each new token adds, without re-decoding the whole output.

A token can end inside a multi-byte character; its text is held back until the character is
complete. Fast tokenizers use the Rust `DecodeStream` (one call a token); others decode a short
window twice, as vLLM does.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        # a wrapper without len() (one that folds ids, say) is decoded through its own decode()
        try:
            self.vocab: int | None = len(tokenizer)
        except TypeError:
            self.vocab = None
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if self._backend is not None and self.vocab is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.prefix_offset = 0  # the window restarts here, a few tokens back, to keep spacing
        self.read_offset = 0  # text up to here has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if (
            self.vocab is not None and token_id >= self.vocab
        ):  # a model vocabulary larger than its tokenizer's: no text
            return ""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
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
        ids = [i for i in self.ids if self.vocab is None or i < self.vocab]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)
