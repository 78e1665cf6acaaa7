"""The attention-backend interface and the per-step layout every backend plans from.

The runner builds one `BatchLayout` per step (CPU index arrays); a backend turns it into its own
metadata once, then each layer calls `forward`, which writes the new K and V into the pool and
attends over every cached position of each request through the page table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from engine.kvcache.pool import KVPool
from engine.kvcache.table import PageTable


@dataclass(frozen=True, slots=True)
class BatchLayout:
    rows: list[int]  # page-table row of each request
    starts: list[int]  # cached length before the step
    ends: list[int]  # length after the step: tokens [start, end) are computed now
    out_loc: torch.Tensor  # KV slot of every new token, in batch order (on the device)
    table: PageTable

    @property
    def is_decode(self) -> bool:
        return all(e - s == 1 for s, e in zip(self.starts, self.ends, strict=True))

    @property
    def qo_indptr(self) -> list[int]:
        out = [0]
        for s, e in zip(self.starts, self.ends, strict=True):
            out.append(out[-1] + e - s)
        return out


class AttentionBackend(ABC):
    name: str

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, layout: BatchLayout) -> Any:
        """Per-step metadata, built once and passed to every layer's `forward`."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: int,
        meta: Any,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k and v: [T, Hk, D] for the step's new tokens; returns [T, Hq, D].
        k and v None: the caller already wrote them at `new_token_slots(meta)`."""
        # write first: a request's new tokens are part of what it attends to
        if k is not None and v is not None:
            self.pool.store(layer, meta.out_loc, k, v)
        return self.attend(q, layer, meta)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: int, meta: Any) -> torch.Tensor:
        """q's attention over every cached position of its request (this step's K and V in)."""

    def new_token_slots(self, meta: Any) -> torch.Tensor | None:
        """Where this step's new K and V go in the pool, for a caller that writes them itself
        (the fused epilogue, engine/kernels/qkv.py); None: pass k and v to `forward`."""
        return None
