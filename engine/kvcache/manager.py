"""KVManager: the one owner of pages. It admits requests against the pool's capacity (with their
whole future reserved), maps pages into the page table as chunks need them, takes them back when
a request ends, and proves that every page is exactly one of used, cached or free."""

from __future__ import annotations

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.prefix import CacheHandle, PrefixCache
from engine.kvcache.table import PageTable
from engine.records import KVStats


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVManager:
    def __init__(
        self, num_pages: int, page_size: int, table: PageTable, cache: PrefixCache
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.allocator = PageAllocator(num_pages)
        self.table = table
        self.cache = cache
        self.mapped_len = [0] * table.slots.shape[0]  # positions of each row that have slots
        self.outstanding = 0  # pages promised to admitted requests, not yet allocated
        self._promised: dict[int, int] = {}  # row -> its part of `outstanding`

    # -- admission -----------------------------------------------------------------------
    def try_admit(self, ids: list[int], max_tokens: int) -> tuple[CacheHandle, int] | None:
        """Match the prefix, take a row and promise every page the request may ever need; or
        change nothing and return None when a row or the pages are not there."""
        if self.table.num_free_rows == 0:
            return None
        handle, pages = self.cache.match(ids)
        self.cache.lock(handle)
        need = pages_for(len(ids) + max_tokens, self.page_size) - len(pages)
        available = self.allocator.num_free + self.cache.evictable_pages - self.outstanding
        if need > available:
            self.cache.unlock(handle)
            return None
        row = self.table.take_row()
        self.table.map_pages(row, 0, pages)
        self.mapped_len[row] = handle.cached_len
        self._promised[row] = need
        self.outstanding += need
        return handle, row

    def map_upto(self, targets: list[tuple[int, int]]) -> None:
        """For each (row, length): make positions [0, length) of the row have slots, drawing on
        the row's promise. All of a step's rows are allocated and mapped together."""
        spans: list[tuple[int, int, int]] = []
        for row, length in targets:
            have = self.mapped_len[row]
            if length > have:
                n = pages_for(length - have, self.page_size)
                spans.append((row, have, n))
                self.mapped_len[row] = have + n * self.page_size
                self._promised[row] -= n
                assert self._promised[row] >= 0, "a request used more pages than it reserved"
        total = sum(n for _, _, n in spans)
        if total:
            self.table.map_spans(spans, self._alloc(total))
            self.outstanding -= total

    def _alloc(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    # -- release -------------------------------------------------------------------------
    def release(self, row: int, handle: CacheHandle, computed_ids: list[int]) -> None:
        """A request ended: its computed KV goes to the prefix cache (or is freed), its
        promise is withdrawn and its row returned."""
        ps = self.page_size
        pages = self.table.pages_of(row, 0, self.mapped_len[row])
        self.allocator.free(self.cache.donate(handle, computed_ids, pages))
        self.outstanding -= self._promised.pop(row)
        self.mapped_len[row] = 0
        self.table.release_row(row)
        assert len(pages) * ps >= len(computed_ids)

    # -- accounting ----------------------------------------------------------------------
    def stats(self, reserved_tokens: int) -> KVStats:
        free = self.allocator.num_free
        cached = self.cache.evictable_pages
        return KVStats(
            self.num_pages, self.num_pages - free - cached, cached, free, reserved_tokens
        )

    def check_integrity(self, active_rows: list[int]) -> None:
        """Every page is exactly one of: free, held by the cache, or held privately by one row
        (pages a row shares with the cache must be locked in it)."""
        free = self.allocator.free_pages()
        locked, unlocked = self.cache.pages()
        cached = set(locked) | set(unlocked)
        assert len(cached) == len(locked) + len(unlocked), "a page appears twice in the cache"
        assert not free & cached, f"pages both free and cached: {sorted(free & cached)[:8]}"
        private: set[int] = set()
        for row in active_rows:
            pages = self.table.pages_of(row, 0, self.mapped_len[row])
            assert len(set(pages)) == len(pages), f"row {row} maps a page twice"
            own = set(pages) - set(locked)
            assert not own & free, f"row {row} holds free pages {sorted(own & free)[:8]}"
            assert not own & set(unlocked), f"row {row} uses unlocked cache pages"
            assert not own & private, f"row {row} shares private pages with another row"
            private |= own
        idle_rows = set(range(len(self.mapped_len))) - set(active_rows)
        assert all(self.mapped_len[r] == 0 for r in idle_rows), "an idle row still maps pages"
        total = len(free) + len(cached) + len(private)
        assert total == self.num_pages, (
            f"pages leaked or double-counted: {len(free)} free + {len(cached)} cached + "
            f"{len(private)} private != {self.num_pages}"
        )
        assert self.outstanding == sum(self._promised.values()) >= 0
        assert self.outstanding <= len(free) + self.cache.evictable_pages, "over-promised pool"
