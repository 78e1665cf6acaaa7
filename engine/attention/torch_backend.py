"""TorchAttention: reads K and V through the page table and runs SDPA.

Prompt pieces run one request at a time; one-token decodes run together, padded to the longest
context, since per-request calls would cost more in dispatch than in arithmetic on a CPU.

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
class _Decodes:
    q_index: torch.Tensor  # [B] rows of q that are one-token decodes
    kv_slots: torch.Tensor  # [B * L]: each decode's L slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L]: True where a key exists


@dataclass(frozen=True, slots=True)
class TorchMeta:
    seqs: list[_Seq]
    decodes: _Decodes | None
    out_loc: torch.Tensor


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, layout: BatchLayout) -> TorchMeta:
        device = self.pool.k.device
        seqs, q0 = [], 0
        dec = [
            (i, row, end)
            for i, (row, start, end) in enumerate(
                zip(layout.rows, layout.starts, layout.ends, strict=True)
            )
            if end - start == 1
        ]
        decodes = None
        if len(dec) > 1:
            decodes = self._batch_decodes(layout, dec, device)
        batched = {i for i, _, _ in dec} if decodes is not None else set()
        for i, (row, start, end) in enumerate(
            zip(layout.rows, layout.starts, layout.ends, strict=True)
        ):
            n = end - start
            if i in batched:
                q0 += n
                continue
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
        return TorchMeta(seqs, decodes, layout.out_loc)

    @staticmethod
    def _batch_decodes(
        layout: BatchLayout, dec: list[tuple[int, int, int]], device: torch.device
    ) -> _Decodes:
        qo = layout.qo_indptr
        longest = max(end for _, _, end in dec)
        rows = torch.tensor([row for _, row, _ in dec])
        ends = torch.tensor([end for _, _, end in dec])
        keep = torch.arange(longest).unsqueeze(0) < ends.unsqueeze(1)  # [B, L]
        slots = layout.table.slots[rows, :longest].masked_fill(~keep, 0)
        return _Decodes(
            q_index=torch.tensor([qo[i] for i, _, _ in dec], device=device),
            kv_slots=slots.flatten().to(device, non_blocking=True),
            mask=keep[:, None, None, :].to(device, non_blocking=True),
        )

    def attend(self, q: torch.Tensor, layer: int, meta: TorchMeta) -> torch.Tensor:
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty_like(q)
        for s in meta.seqs:
            qi = q[s.q0 : s.q1].transpose(0, 1)  # [Hq, n, D]
            ki = k_all.index_select(0, s.kv_slots).transpose(0, 1)  # [Hk, L, D]
            vi = v_all.index_select(0, s.kv_slots).transpose(0, 1)
            # with a leading batch dimension: PyTorch's CPU flash kernel takes 4-D inputs only,
            # and 3-D ones go down its math path, 4-7x slower on a long prompt (same values)
            oi = F.scaled_dot_product_attention(
                qi[None], ki[None], vi[None], attn_mask=s.mask, is_causal=s.causal,
                scale=self.scale, enable_gqa=True,
            )  # fmt: skip
            out[s.q0 : s.q1] = oi[0].transpose(0, 1)
        if (d := meta.decodes) is not None:
            qd = q.index_select(0, d.q_index).unsqueeze(2)  # [B, Hq, 1, D]
            # index_select on flat slots: on CPU ~10x faster than indexing with a [B, L] tensor
            shape = (d.mask.shape[0], d.mask.shape[-1], *k_all.shape[1:])  # [B, L, Hk, D]
            kd = k_all.index_select(0, d.kv_slots).view(shape).transpose(1, 2)  # [B, Hk, L, D]
            vd = v_all.index_select(0, d.kv_slots).view(shape).transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=d.mask, scale=self.scale, enable_gqa=True
            )
            out[d.q_index] = od.squeeze(2)
        return out
