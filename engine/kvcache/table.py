"""PageTable: one row per request slot mapping each position of the request to its KV slot."""

from __future__ import annotations

import torch


class PageTable:
    def __init__(self, max_running_req: int, max_seq_len: int, page_size: int) -> None:
        self.page_size = page_size
        # one spare position so a request at max_seq_len can still be written past its end
        self.slots = torch.zeros((max_running_req, max_seq_len + page_size), dtype=torch.int64)
        self._free_rows = list(range(max_running_req - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def take_row(self) -> int:
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def map_pages(self, row: int, start: int, pages: list[int]) -> None:
        """Give positions [start, start + len(pages) * page_size) the slots of `pages`."""
        ps = self.page_size
        if not pages:
            return
        base = torch.tensor(pages, dtype=torch.int64).repeat_interleave(ps) * ps
        offs = torch.arange(ps, dtype=torch.int64).repeat(len(pages))
        self.slots[row, start : start + len(pages) * ps] = base + offs

    def pages_of(self, row: int, start: int, end: int) -> list[int]:
        """The pages behind positions [start, end); both page-aligned."""
        ps = self.page_size
        return (self.slots[row, start:end:ps] // ps).tolist()
