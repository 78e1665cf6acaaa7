"""Kernel configurations pinned for a check, whatever a tuned table would choose."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def gemv_pinned(path: Path, rows: tuple[int, ...], cfg: Any) -> Iterator[None]:
    """Every weight of the model at `path` through engine/kernels/gemv.py's `cfg` at these
    row classes, whatever a tuned table would choose; the table is put back after."""
    from engine.kernels import gemv as G

    c = json.loads((path / "config.json").read_text())
    h, heads, kv, d = (c[k] for k in ("hidden_size", "num_attention_heads",
                                      "num_key_value_heads", "head_dim"))  # fmt: skip
    inter, vocab = c["intermediate_size"], c["vocab_size"]
    shapes = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter), (vocab, h)]
    saved = dict(G.TABLE.choices)
    for n, k in shapes:
        for r in rows:
            G.set_choice(n, k, r, cfg)
    try:
        yield
    finally:
        G.TABLE.choices.clear()
        G.TABLE.choices.update(saved)
