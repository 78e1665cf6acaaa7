"""TritonAttention: the batch-invariant paged attention kernel (engine.kernels.attention) as a
backend, for prefill, mixed and decode steps alike, and for decode CUDA graphs.

`LLM(batch_invariant=True)` runs it with the batch-invariant matmul: a request's logits are then
the same bits alone or in any batch, whole or chunked, which FlashInfer's kernels, tiled and split
by the batch's shape, do not promise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.attention.pages import page_index
from engine.kernels.attention import BLOCK_M, paged_attention, tiles
from engine.kvcache.pool import KVPool
from engine.kvcache.table import PageTable


@dataclass(frozen=True, slots=True)
class TritonMeta:
    tile_req: torch.Tensor  # int32 [tiles]: each program's request
    tile_q0: torch.Tensor  # int32 [tiles]: its first query within the request
    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_len: torch.Tensor  # int32 [B]: cached length after the step
    page_indptr: torch.Tensor  # int32 [B + 1]
    page_indices: torch.Tensor  # int32 [pages]
    out_loc: torch.Tensor  # KV slot of every new token


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads
        if self.group > BLOCK_M:
            raise ValueError(
                f"the triton backend fits at most {BLOCK_M} query heads per KV head, "
                f"this model has {self.group}"
            )
        self.device = pool.k.device
        self.page_size = pool.page_size
        self._graph_indices: torch.Tensor | None = None

    def prepare(self, layout: BatchLayout) -> TritonMeta:
        qo = layout.qo_indptr
        n = len(layout.rows)
        treq, tq0 = tiles([qo[i + 1] - qo[i] for i in range(n)], self.group)
        idx = page_index(layout.table, layout.rows, layout.ends, self.page_size)
        head = torch.tensor(treq + tq0 + qo + layout.ends, dtype=torch.int32)
        # one host-to-device copy for the step, then views into it
        buf = torch.cat([head, idx.indptr, idx.indices]).to(self.device, non_blocking=True)
        t = len(treq)
        cuts = [t, t, n + 1, n, n + 1, idx.indices.numel()]
        parts = buf.split(cuts)
        return TritonMeta(*parts, out_loc=layout.out_loc)

    def attend(self, q: torch.Tensor, layer: int, meta: TritonMeta) -> torch.Tensor:
        return paged_attention(
            q,
            self.pool.k[layer],
            self.pool.v[layer],
            meta.tile_req,
            meta.tile_q0,
            meta.qo_indptr,
            meta.kv_len,
            meta.page_indptr,
            meta.page_indices,
            self.page_size,
            self.scale,
        )

    # -- CUDA graphs ---------------------------------------------------------------------
    def graph_meta(self, batch_size: int, out_loc: torch.Tensor, max_pages: int) -> TritonMeta:
        """Metadata in fixed buffers for a decode graph of `batch_size` one-query requests: one
        tile each, so the grid is fixed; `plan_graph` refills lengths and pages. Every graph
        shares the page-indices buffer, since one graph runs at a time."""
        if self._graph_indices is None or self._graph_indices.numel() < max_pages:
            self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        g = batch_size
        ar = torch.arange(g + 1, dtype=torch.int32, device=self.device)
        return TritonMeta(
            tile_req=ar[:g],
            tile_q0=torch.zeros(g, dtype=torch.int32, device=self.device),
            qo_indptr=ar,
            kv_len=torch.ones(g, dtype=torch.int32, device=self.device),
            page_indptr=ar.clone(),
            page_indices=self._graph_indices,
            out_loc=out_loc,
        )

    def plan_graph(
        self,
        meta: TritonMeta,
        table: PageTable,
        rows: list[int],
        lengths: list[int],
        pad_page: int,
    ) -> None:
        """Point a graph's buffers at these requests, padded with one-token rows on `pad_page`."""
        pad = meta.kv_len.numel() - len(rows)
        idx = page_index(table, rows, lengths, self.page_size, pad, pad_page)
        meta.kv_len.copy_(torch.tensor(lengths + [1] * pad, dtype=torch.int32), non_blocking=True)
        meta.page_indptr.copy_(idx.indptr, non_blocking=True)
        meta.page_indices[: idx.indices.numel()].copy_(idx.indices, non_blocking=True)
