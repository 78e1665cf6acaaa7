"""NaiveCache: no prefix reuse. Every prompt is computed in full and its pages freed at the end."""

from __future__ import annotations

from engine.kvcache.prefix import CacheHandle, PrefixCache


class NaiveCache(PrefixCache):
    shares_prefixes = False

    def match(self, ids: list[int]) -> tuple[CacheHandle, list[int]]:
        return CacheHandle(0), []

    def pages_to_lock(self, handle: CacheHandle) -> int:
        return 0

    def lock(self, handle: CacheHandle) -> None:
        pass  # nothing is shared, so nothing needs protecting

    def unlock(self, handle: CacheHandle) -> None:
        pass

    def insert(self, handle: CacheHandle, ids: list[int], pages: list[int]) -> list[int]:
        raise NotImplementedError("a NaiveCache keeps no prefix: nothing is inserted")

    def donate(self, handle: CacheHandle, ids: list[int], pages: list[int]) -> list[int]:
        return list(pages)

    def evict(self, num_pages: int) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def locked_pages(self) -> int:
        return 0

    def page_runs(self) -> list[tuple[bool, list[int]]]:
        return []
