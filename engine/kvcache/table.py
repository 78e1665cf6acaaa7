"""PageTable: one row per request slot mapping each position of the request to its KV slot."""

from __future__ import annotations

import torch


class PageTable:
    def __init__(self, max_running_req: int, max_seq_len: int, page_size: int) -> None:
        self.page_size = page_size
        # one spare position so a request at max_seq_len can still be written past its end
        self.slots = torch.zeros((max_running_req, max_seq_len + page_size), dtype=torch.int64)
        self._free_rows = list(range(max_running_req - 1, -1, -1))
        # per row, how often entries it already had were pointed at other pages (`remap`):
        # copies of the table elsewhere (other ranks) must then take the row again
        self.remaps = [0] * max_running_req

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def take_row(self) -> int:
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def map_pages(self, row: int, start: int, pages: list[int]) -> None:
        """Give positions [start, start + len(pages) * page_size) the slots of `pages`."""
        self.map_spans([(row, start, len(pages))], pages)

    def remap(self, row: int, start: int, pages: list[int]) -> None:
        """Point positions the row already maps at `pages` instead (a running request's pages
        that duplicate the prefix cache's, given back)."""
        self.map_spans([(row, start, len(pages))], pages)
        self.remaps[row] += 1

    def map_spans(self, spans: list[tuple[int, int, int]], pages: list[int]) -> None:
        """For each (row, start, n): positions [start, start + n * page_size) of that row get
        the next n of `pages`. One indexed write for the whole step, not one per request."""
        if not pages:
            return
        ps = self.page_size
        rows: list[int] = []
        positions: list[int] = []
        for row, start, n in spans:
            rows += [row] * (n * ps)
            positions += range(start, start + n * ps)
        slots = torch.tensor(pages, dtype=torch.int64)
        if ps > 1:
            slots = slots.repeat_interleave(ps) * ps + torch.arange(ps).repeat(len(pages))
        self.slots[torch.tensor(rows), torch.tensor(positions)] = slots

    def pages_of(self, row: int, start: int, end: int) -> list[int]:
        """The pages behind positions [start, end); both page-aligned."""
        ps = self.page_size
        return (self.slots[row, start:end:ps] // ps).tolist()
