"""KVPool: the K and V buffers of every layer, `num_pages * page_size` token slots each.

A token's KV lives at one slot; slot `s` is in page `s // page_size`. The page table maps a
request's positions to slots, so attention reads K and V through it wherever they landed.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.num_slots = num_pages * page_size
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V as [num_pages, page_size, heads, dim] (FlashInfer's NHD layout)."""
        shape = (self.num_pages, self.page_size, *self.k.shape[2:])
        return self.k[layer].view(shape), self.v[layer].view(shape)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
