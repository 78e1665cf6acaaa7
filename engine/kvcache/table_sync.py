"""TableSync: keeps the other tensor-parallel ranks' copies of the page table in step with rank
0's, by sending each step only the entries they have not seen.

Rank 0's scheduler owns the page table; the other ranks need the entries of the rows a step
uses (attention reads K and V through them). A row's entries rarely change while one request
holds it: pages are added after its end, and the entries change only when the request's own
pages turn out to duplicate the prefix cache's and are swapped for them (`PageTable.remap`). So
rank 0 remembers, per row, which request it last sent entries for, after how many remaps, and
up to which position: a decode step then sends one slot per request, a prefix-cache hit sends
the cached prefix once, and a row taken by a new request, or remapped, is sent again from
position 0.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.kvcache.table import PageTable

Span = tuple[int, int, int]  # (row, start, count): positions [start, start + count) of a row


class RowUser(Protocol):
    """What TableSync reads of a request in a step (engine.request.Req)."""

    @property
    def tenancy(self) -> tuple[int, int]: ...

    table_idx: int
    device_len: int


class TableSync:
    def __init__(self) -> None:
        # row -> ((tenancy, remaps), positions sent); tenancy: (uid, retractions), one
        # admission; remaps: the table's count for the row when it was sent
        self._sent: dict[int, tuple[tuple[tuple[int, int], int], int]] = {}

    def updates(self, reqs: list[RowUser], table: PageTable) -> tuple[list[Span], list[int]]:
        """The entries positions [0, device_len) of each request's row need and have not been
        sent yet: their spans and, in span order, their slot ids."""
        spans: list[Span] = []
        rows: list[int] = []
        positions: list[int] = []
        for req in reqs:
            row, end = req.table_idx, req.device_len
            tenant = (req.tenancy, table.remaps[row])
            seen, sent = self._sent.get(row, (((-1, 0), 0), 0))
            start = sent if seen == tenant else 0
            if end > start:
                spans.append((row, start, end - start))
                rows += [row] * (end - start)
                positions += range(start, end)
                self._sent[row] = (tenant, end)
        if not spans:
            return [], []
        # one gather for the step rather than a slice per request
        return spans, table.slots[torch.tensor(rows), torch.tensor(positions)].tolist()


def apply_updates(table: PageTable, spans: list[Span], slots: list[int]) -> None:
    """Write entries from `TableSync.updates` into another rank's copy of the table."""
    if not spans:
        return
    rows: list[int] = []
    positions: list[int] = []
    for row, start, n in spans:
        rows += [row] * n
        positions += range(start, start + n)
    table.slots[torch.tensor(rows), torch.tensor(positions)] = torch.tensor(
        slots, dtype=torch.int64
    )
