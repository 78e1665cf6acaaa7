"""IncrementalDetokenizer: the text each new token adds, without re-decoding the whole output;
StopMatcher: where the first stop string ends that text.

A token can end inside a multi-byte character; its text is held back until the character is
complete. Fast tokenizers use the Rust `DecodeStream` (one `step` per token); others decode a short
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


class StopMatcher:
    """Finds the first stop string in text that arrives in pieces.

    `push` returns the text that is safe to show now: everything except a tail that could still
    become the start of a stop string (held back, as vLLM does). `stopped` is set once a stop
    string is complete; the text before it (with it, if `include_stop`) is then all that is ever
    shown.
    """

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self.stops = stops
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything generated so far, stop string included
        self.shown = 0  # characters of `text` returned so far
        self.stopped = False

    def push(self, piece: str) -> str:
        if not self.stops:
            return piece  # nothing to hold back (and no text to keep)
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.hold)  # a match may begin in the held tail
        self.text += piece
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) != -1]
            if hits:
                at, stop = min(hits)
                self.stopped = True
                self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
                return self._show(len(self.text))
        return self._show(max(self.shown, len(self.text) - self.hold))

    def flush(self) -> str:
        """At the end of generation: the held-back tail (nothing after a stop)."""
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        out = self.text[self.shown : upto]
        self.shown = max(self.shown, upto)
        return out
