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


class PrefixCache(ABC):
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match(self, ids: list[int]) -> tuple[CacheHandle, list[int]]:
        """The longest cached, page-aligned prefix of `ids`, leaving at least its last token to
        compute; returns the handle (not yet locked) and the pages behind the prefix."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's pages from eviction while a request uses them."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None: ...

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

    @abstractmethod
    def pages(self) -> tuple[list[int], list[int]]:
        """(locked pages, unlocked pages) the cache holds, for integrity checks."""

    def reset(self) -> list[int]:
        """Drop every unlocked entry; returns the released pages."""
        return self.evict(self.evictable_pages)
