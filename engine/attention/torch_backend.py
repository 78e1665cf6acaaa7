"""TorchAttention: reads K and V through the page table and runs SDPA one request at a time.

The reference backend: exact, simple, and the CPU path. A chunk after a cached prefix attends to
the prefix and to itself causally, which is the same computation as a prefix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout


@dataclass(frozen=True, slots=True)
class _Seq:
    q0: int
    q1: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None  # None: no mask (one query) or plain causal (no prefix)
    causal: bool


@dataclass(frozen=True, slots=True)
class TorchMeta:
    seqs: list[_Seq]
    out_loc: torch.Tensor


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, layout: BatchLayout) -> TorchMeta:
        device = self.pool.k.device
        seqs, q0 = [], 0
        for row, start, end in zip(layout.rows, layout.starts, layout.ends, strict=True):
            n = end - start
            slots = layout.table.slots[row, :end].to(device, non_blocking=True)
            mask, causal = None, False
            if n > 1 and start == 0:
                causal = True
            elif n > 1:
                # query i sits at position start + i and sees keys 0 ..= start + i
                qpos = torch.arange(start, end, device=device).unsqueeze(1)
                mask = torch.arange(end, device=device).unsqueeze(0) <= qpos
            seqs.append(_Seq(q0, q0 + n, slots, mask, causal))
            q0 += n
        return TorchMeta(seqs, layout.out_loc)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: TorchMeta
    ) -> torch.Tensor:
        # write first: a request's new tokens are part of what it attends to
        self.pool.store(layer, meta.out_loc, k, v)
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty_like(q)
        for s in meta.seqs:
            qi = q[s.q0 : s.q1].transpose(0, 1)  # [Hq, n, D]
            ki = k_all.index_select(0, s.kv_slots).transpose(0, 1)  # [Hk, L, D]
            vi = v_all.index_select(0, s.kv_slots).transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=s.mask, is_causal=s.causal, scale=self.scale, enable_gqa=True
            )
            out[s.q0 : s.q1] = oi.transpose(0, 1)
        return out
