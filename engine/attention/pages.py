"""Page indices of a batch, as FlashInfer and the Triton backend read a paged KV cache: request
i owns pages `indices[indptr[i]:indptr[i+1]]`, the last of them filled to `last_page_len[i]`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kvcache.table import PageTable


@dataclass(frozen=True, slots=True)
class PageIndex:
    """A batch's pages, as FlashInfer and the Triton kernel read them."""

    indptr: torch.Tensor  # int32 [B + 1]
    indices: torch.Tensor  # int32 [pages]
    last_page_len: torch.Tensor  # int32 [B], in 1 ..= page_size


def page_index(
    table: PageTable,
    rows: list[int],
    lengths: list[int],
    page_size: int,
    pad_rows: int = 0,
    pad_page: int = 0,
) -> PageIndex:
    """The pages behind positions [0, length) of each row, as CPU int32 arrays, plus `pad_rows`
    one-token requests on `pad_page` (the padding of a CUDA-graph batch)."""
    lens = torch.tensor(lengths + [1] * pad_rows, dtype=torch.int64)
    npages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(npages, 0, out=indptr[1:])
    last = (lens - (npages - 1) * page_size).to(torch.int32)
    if rows:
        real = npages[: len(rows)]
        width = int(real.max())
        # the first slot of every page a row maps, gathered for all rows at once
        firsts = table.slots[:, : width * page_size : page_size][torch.tensor(rows)]
        keep = torch.arange(width).unsqueeze(0) < real.unsqueeze(1)
        pages = firsts[keep] // page_size
    else:
        pages = torch.empty(0, dtype=torch.int64)
    if pad_rows:
        pages = torch.cat([pages, torch.full((pad_rows,), pad_page, dtype=torch.int64)])
    return PageIndex(indptr, pages.to(torch.int32), last)
