"""PageAllocator: which pages are free. Pages are handed out and returned whole."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # a stack: recently freed pages are reused first, which keeps the pool compact
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise AssertionError(f"page {p} freed twice")
            self._is_free[p] = True
        self._free.extend(reversed(pages))

    def free_list(self) -> list[int]:
        """A copy of the free stack (one C-level copy; for integrity snapshots)."""
        return list(self._free)
