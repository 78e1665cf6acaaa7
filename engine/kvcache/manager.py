"""KVManager: the one owner of pages. It admits requests against the pool's capacity (promising
the pages the admission rule asks for), maps pages into the page table as chunks and decodes
need them, gives a running request's computed whole pages to the prefix cache after each piece
of prompt work (locked for it), takes them back when a request ends or is retracted, and proves
that every page is exactly one of used, cached or free.

The proof has two parts. Counters kept as pages move (free, cached locked / unlocked, private to
a row) must add up to the pool: O(rows), cheap enough for every `stats` command. The full check,
page by page, runs on a `KVSnapshot`: taking one copies the accounting (list and tensor copies,
plus one walk over the radix tree's nodes), and checking it needs no engine state, so it can run
on another thread while the engine keeps stepping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.prefix import CacheHandle, PrefixCache
from engine.kvcache.table import PageTable
from instrumentation.protocol import WaitReason
from instrumentation.records import KVStats


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(frozen=True)
class KVSnapshot:
    """A copy of the page accounting at one moment, checkable away from the engine thread."""

    num_pages: int
    page_size: int
    free: list[int]
    cache_runs: list[tuple[bool, list[int]]]  # (locked, pages) per cache entry
    cache_locked: int  # the cache's own counters, to compare with its entries
    cache_evictable: int
    active_rows: list[int]
    row_slots: torch.Tensor  # [len(active_rows), longest mapped length] slot ids
    mapped_len: list[int]  # every row, idle ones included
    private: dict[int, int]  # row -> pages it allocated (not from the cache)
    promised: dict[int, int]
    outstanding: int

    def verdict(self) -> str:
        """'ok', or 'failed: <the first broken invariant>'."""
        try:
            self.check()
        except AssertionError as exc:
            return f"failed: {exc}"
        return "ok"

    def check(self) -> None:
        """Every page is exactly one of: free, held by the cache, or held privately by one row
        (pages a row shares with the cache must be locked in it). Raises AssertionError."""
        check_counts(
            self.num_pages,
            len(self.free),
            self.cache_locked,
            self.cache_evictable,
            sum(self.private.values()),
            self.outstanding,
            self.promised,
        )
        free = set(self.free)
        assert len(free) == len(self.free), "a page is on the free list twice"
        locked: set[int] = set()
        unlocked: set[int] = set()
        n_locked = n_unlocked = 0
        for is_locked, run in self.cache_runs:
            (locked if is_locked else unlocked).update(run)
            n_locked += len(run) if is_locked else 0
            n_unlocked += 0 if is_locked else len(run)
        assert (n_locked, n_unlocked) == (self.cache_locked, self.cache_evictable), (
            f"cache counters drifted: locked {n_locked} vs {self.cache_locked}, "
            f"evictable {n_unlocked} vs {self.cache_evictable}"
        )
        cached = locked | unlocked
        assert len(cached) == n_locked + n_unlocked, "a page appears twice in the cache"
        assert not free & cached, f"pages both free and cached: {sorted(free & cached)[:8]}"
        private: set[int] = set()
        ps = self.page_size
        for i, row in enumerate(self.active_rows):
            pages = (self.row_slots[i, : self.mapped_len[row] : ps] // ps).tolist()
            assert len(set(pages)) == len(pages), f"row {row} maps a page twice"
            own = set(pages) - locked
            assert not own & free, f"row {row} holds free pages {sorted(own & free)[:8]}"
            assert not own & unlocked, f"row {row} uses unlocked cache pages"
            assert not own & private, f"row {row} shares private pages with another row"
            assert len(own) == self.private.get(row, 0), f"row {row}'s private count drifted"
            private |= own
        active = set(self.active_rows)
        assert all(n == 0 for r, n in enumerate(self.mapped_len) if r not in active), (
            "an idle row still maps pages"
        )
        assert set(self.private) <= active, "an idle row still counts private pages"
        total = len(free) + len(cached) + len(private)
        assert total == self.num_pages, (
            f"pages leaked or double-counted: {len(free)} free + {len(cached)} cached + "
            f"{len(private)} private != {self.num_pages}"
        )


def check_counts(
    num_pages: int,
    free: int,
    locked: int,
    evictable: int,
    private: int,
    outstanding: int,
    promised: dict[int, int],
) -> None:
    """The counter invariants, O(rows): the four kinds of page add up to the pool, and what is
    promised can be delivered."""
    assert free + locked + evictable + private == num_pages, (
        f"pages leaked or double-counted: {free} free + {locked} locked + {evictable} cached + "
        f"{private} private != {num_pages}"
    )
    assert outstanding == sum(promised.values()) >= 0, "promises drifted"
    assert all(n >= 0 for n in promised.values()), "a row used more pages than it reserved"
    assert outstanding <= free + evictable, "over-promised pool"


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
        self._private: dict[int, int] = {}  # row -> pages allocated to it (not from the cache)
        self._num_private = 0
        self._matched: dict[int, int] = {}  # row -> pages its admission's prefix match served

    # -- admission -----------------------------------------------------------------------
    def try_admit(
        self, ids: list[int], promise_tokens: int, hold_pages: int = 0, cached: bool = True
    ) -> tuple[CacheHandle, int] | WaitReason:
        """Match the prefix, take a row and promise the pages of the request's first
        `promise_tokens` tokens (reserve: prompt plus `max_tokens`; optimistic: the prompt),
        keeping `hold_pages` more free for what admitted requests are estimated to need. Or
        change nothing (not even the cache's LRU order) and say why not: `max_running` (no
        row), `kv` (not enough free and evictable pages), `reserved` (enough, but promised or
        held for admitted requests). Not `cached`: no prefix match (every position is computed)."""
        if self.table.num_free_rows == 0:
            return "max_running"
        handle, pages = self.cache.match(ids if cached else ids[:1])  # one token matches none
        need = pages_for(promise_tokens, self.page_size) - len(pages)
        # the matched pages stop being evictable once locked, so they cannot count as room
        room = self.allocator.num_free + self.cache.evictable_pages
        room -= self.cache.pages_to_lock(handle)
        if need + hold_pages > room:
            return "kv"
        if need + hold_pages > room - self.outstanding:
            return "reserved"
        self.cache.lock(handle)
        row = self.table.take_row()
        self.table.map_pages(row, 0, pages)
        self.mapped_len[row] = handle.cached_len
        self._promised[row] = need
        self._private[row] = 0
        self._matched[row] = len(pages)
        self.outstanding += need
        return handle, row

    def available(self) -> int:
        """Pages that can be drawn beyond the promises: free plus evictable minus promised."""
        return self.allocator.num_free + self.cache.evictable_pages - self.outstanding

    def extra_pages(self, row: int, length: int) -> int:
        """Pages that mapping the row up to `length` needs beyond the row's own promise."""
        have = self.mapped_len[row]
        if length <= have:
            return 0
        return max(0, pages_for(length - have, self.page_size) - self._promised[row])

    def map_upto(self, targets: list[tuple[int, int]]) -> None:
        """For each (row, length): make positions [0, length) of the row have slots, drawing on
        the row's promise first and on `available()` pages beyond it (an optimistic admission's
        outputs; the scheduler makes room first). All of a step's rows are mapped together."""
        spans: list[tuple[int, int, int]] = []
        promised = extra = 0
        for row, length in targets:
            have = self.mapped_len[row]
            if length > have:
                n = pages_for(length - have, self.page_size)
                spans.append((row, have, n))
                self.mapped_len[row] = have + n * self.page_size
                take = min(n, self._promised[row])
                self._promised[row] -= take
                self._private[row] += n
                promised += take
                extra += n - take
        assert extra <= self.available(), "pages drawn beyond the promises that are not there"
        total = promised + extra
        if total:
            self.table.map_spans(spans, self._alloc(total))
            self.outstanding -= promised
            self._num_private += total

    def _alloc(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    # -- sharing while running ------------------------------------------------------------
    def cache_running(self, row: int, handle: CacheHandle, ids: list[int], computed: int) -> None:
        """The row's request has the KV of `ids[:computed]` (prompt work just launched): its
        whole pages join the prefix cache, locked for it, so a request admitted from the next
        step on matches them (SGLang's `cache_unfinished_req`). Pages the cache held already
        (another request computed the same tokens first) are freed, and the row reads the
        cache's instead, so the pool holds that prefix once. Those pages stop being the row's
        own: they count as locked cache pages from now on."""
        if not self.cache.shares_prefixes:
            return
        ps = self.page_size
        start, end = handle.cached_len, computed // ps * ps
        if end <= start:
            return
        pages = self.table.pages_of(row, start, end)
        duplicates = self.cache.insert(handle, ids[:end], pages)
        if duplicates:
            # the step that wrote them may still run (overlap); the next one to reuse them is
            # launched after it, on the same stream, so it writes them after that step is done
            self.allocator.free(pages[: len(duplicates)])
            self.table.remap(row, start, duplicates)
        self._private[row] -= len(pages)
        self._num_private -= len(pages)

    # -- release -------------------------------------------------------------------------
    def release(self, row: int, handle: CacheHandle, computed_ids: list[int]) -> None:
        """A request ended: its computed KV goes to the prefix cache (or is freed), its
        promise is withdrawn and its row returned."""
        ps = self.page_size
        pages = self.table.pages_of(row, 0, self.mapped_len[row])
        self.allocator.free(self.cache.donate(handle, computed_ids, pages))
        self.outstanding -= self._promised.pop(row)
        self._num_private -= self._private.pop(row)
        del self._matched[row]
        self.mapped_len[row] = 0
        self.table.release_row(row)
        assert len(pages) * ps >= len(computed_ids)

    def flush_cache(self) -> int:
        """Free every cached page no request holds (SGLang's /flush_cache); how many."""
        pages = self.cache.evict(self.cache.evictable_pages)
        self.allocator.free(pages)
        return len(pages)

    # -- accounting ----------------------------------------------------------------------
    def stats(self, reserved_tokens: int) -> KVStats:
        free = self.allocator.num_free
        cached = self.cache.evictable_pages
        return KVStats(
            self.num_pages, self.num_pages - free - cached, cached, free, reserved_tokens
        )

    def check_counters(self) -> None:
        """The cheap part of the integrity check: O(rows), no page lists."""
        check_counts(
            self.num_pages,
            self.allocator.num_free,
            self.cache.locked_pages,
            self.cache.evictable_pages,
            self._num_private,
            self.outstanding,
            self._promised,
        )
        assert self._num_private == sum(self._private.values()), "private count drifted"

    def snapshot(self, active_rows: list[int]) -> KVSnapshot:
        """Copy the accounting (engine thread, between steps); `.check()` may run anywhere."""
        longest = max((self.mapped_len[r] for r in active_rows), default=0)
        rows = torch.tensor(active_rows, dtype=torch.int64)
        return KVSnapshot(
            num_pages=self.num_pages,
            page_size=self.page_size,
            free=self.allocator.free_list(),
            cache_runs=self.cache.page_runs(),
            cache_locked=self.cache.locked_pages,
            cache_evictable=self.cache.evictable_pages,
            active_rows=list(active_rows),
            row_slots=self.table.slots[rows, :longest],  # advanced indexing copies
            mapped_len=list(self.mapped_len),
            private=dict(self._private),
            promised=dict(self._promised),
            outstanding=self.outstanding,
        )

    def check_integrity(self, active_rows: list[int]) -> None:
        """Both parts, here and now (tests, benchmarks)."""
        self.check_counters()
        self.snapshot(active_rows).check()

    # -- the pool page by page (the `kv_map` command) ---------------------------------------
    def page_map(self, owners: dict[int, int], reserved_tokens: int) -> PageMap:
        """Every page's state and owner, run-length encoded. `owners` maps each active row to
        its request's uid. O(pages) tensor work plus one pass over the cache's entries, so it is
        cheap enough to run between two steps whenever a page map is open."""
        n, ps = self.num_pages, self.page_size
        state = torch.zeros(n, dtype=torch.int64)  # PAGE_STATES codes; 0: free
        for locked, pages in self.cache.page_runs():
            if pages:
                state[torch.tensor(pages, dtype=torch.int64)] = 3 if locked else 1
        owner = torch.full((n,), -1, dtype=torch.int64)
        sharers = torch.zeros(n, dtype=torch.int64)
        hit = torch.zeros(n, dtype=torch.bool)
        for row, uid in owners.items():
            pages = self.table.slots[row, : self.mapped_len[row] : ps] // ps
            if not len(pages):
                continue
            owner[pages] = uid  # a page several requests share shows one of them
            sharers[pages] += 1  # a row maps each page once (the integrity check's rule)
            hit[pages[: self._matched.get(row, 0)]] = True
            state[pages[state[pages] == 0]] = 2  # its own pages; locked cache pages stay shared
        # a locked cache page that only the request which computed it maps (its prompt, given
        # to the cache while it runs) is that request's own until another one uses it
        state[(state == 3) & ~hit & (sharers == 1)] = 2
        change = torch.ones(n, dtype=torch.bool)
        change[1:] = (
            (state[1:] != state[:-1]) | (owner[1:] != owner[:-1]) | (sharers[1:] != sharers[:-1])
        )
        starts = change.nonzero().flatten()
        lengths = torch.diff(starts, append=torch.tensor([n]))
        runs = torch.stack([lengths, state[starts], owner[starts], sharers[starts]], 1)
        return PageMap(n, ps, runs.tolist(), self.outstanding, reserved_tokens)


PAGE_STATES = ("free", "cached", "used", "shared")


@dataclass(frozen=True)
class PageMap:
    """The pool page by page, in page order, as runs of `[length, state, uid, sharers]`:
    `state` indexes PAGE_STATES (`cached`: only the prefix cache holds it, evictable; `shared`:
    a prefix-cache page that requests in flight use: a radix hit, or a page of a running
    request's prompt that another request maps too), `uid` is the owning request
    (-1: none; a shared page names one of its users) and `sharers` how many requests map it."""

    num_pages: int
    page_size: int
    runs: list[list[int]]
    reserved_pages: int  # promised to admitted requests, not yet allocated
    reserved_tokens: int

    def to_dict(self) -> dict:
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "states": list(PAGE_STATES),
            "runs": self.runs,
            "reserved_pages": self.reserved_pages,
            "reserved_tokens": self.reserved_tokens,
        }
