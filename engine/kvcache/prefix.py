"""The prefix-cache interface: match a prompt's cached prefix, lock it, take KV back when done.

Two implementations: `RadixCache` (shares page-aligned prefixes between requests) and
`NaiveCache` (keeps nothing). The scheduler talks only to this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class CacheHandle:
    """What a request holds from the cache: `cached_len` tokens of KV, locked until released."""

    cached_len: int
    node: Any = None
    # radix: the match ends after this many pages of `node` (0: it covers all of `node`);
    # `lock` cuts the node there, so a match alone never changes the tree
    split_at: int = 0


class PrefixCache(ABC):
    # whether a running request's computed pages are worth inserting (`insert`) at all
    shares_prefixes = True

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match(self, ids: list[int]) -> tuple[CacheHandle, list[int]]:
        """The longest cached, page-aligned prefix of `ids`, leaving at least its last token to
        compute; returns the handle (not yet locked) and the pages behind the prefix. Changes
        nothing: neither the cache's structure nor its LRU order."""

    @abstractmethod
    def pages_to_lock(self, handle: CacheHandle) -> int:
        """How many evictable pages `lock(handle)` would take out of `evictable_pages`."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's pages from eviction while a request uses them (and count them
        as just used)."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def insert(self, handle: CacheHandle, ids: list[int], pages: list[int]) -> list[int]:
        """A running request has computed `ids` (page-aligned, longer than `handle.cached_len`);
        `pages` hold the KV of `ids[handle.cached_len:]`. Adds them to the cache and extends the
        request's lock (and `handle`, in place) to all of `ids`. Returns the cache's pages for
        the leading part of `pages` that it held already: the caller's pages there are
        duplicates, to free, and the request must read these instead."""

    @abstractmethod
    def donate(self, handle: CacheHandle, ids: list[int], pages: list[int]) -> list[int]:
        """A request is done: `pages` (in position order) hold the KV of `ids` (the request's
        computed tokens; the last page may be partly filled). Unlocks `handle`, keeps what the
        cache wants, and returns the pages the caller must free."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Drop unlocked entries, least recently used first, until `num_pages` pages are
        released (or nothing is left to drop); returns the released pages."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages held only by the cache: no request has them locked."""

    @property
    @abstractmethod
    def locked_pages(self) -> int:
        """Pages of the cache that at least one request has locked."""

    @abstractmethod
    def page_runs(self) -> list[tuple[bool, list[int]]]:
        """(locked, pages) for every entry, for integrity checks. The page lists are the
        cache's own and never changed in place, so the result stays a valid snapshot."""

    def pages(self) -> tuple[list[int], list[int]]:
        """(locked pages, unlocked pages) the cache holds, for integrity checks."""
        locked: list[int] = []
        unlocked: list[int] = []
        for is_locked, run in self.page_runs():
            (locked if is_locked else unlocked).extend(run)
        return locked, unlocked

    def reset(self) -> list[int]:
        """Drop every unlocked entry; returns the released pages."""
        return self.evict(self.evictable_pages)
