"""RadixCache: a radix tree of page-aligned token runs and the KV pages that hold them.

Requests lock the path they matched (reference counts up to the root); unlocked leaves are
evicted least recently used first when the pool needs pages.
"""

from __future__ import annotations

import heapq
import itertools

from engine.kvcache.prefix import CacheHandle, PrefixCache


class Node:
    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: Node | None) -> None:
        self.key = key  # tokens, len(key) == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_access = 0


class RadixCache(PrefixCache):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.root = Node([], [], None)
        self.root.ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self._evictable = 0
        self._locked = 0

    # -- matching ------------------------------------------------------------------------
    def _first_page(self, ids: list[int], at: int) -> tuple[int, ...]:
        return tuple(ids[at : at + self.page_size])

    def _walk(self, ids: list[int]) -> tuple[Node, int, list[int]]:
        """Deepest node whose path is a prefix of `ids` (splitting a node at a page boundary when
        the match ends inside it); returns it, the matched length and the matched pages."""
        ps, node, pos, pages = self.page_size, self.root, 0, []
        now = next(self._clock)
        node.last_access = now
        while pos + ps <= len(ids):
            child = node.children.get(self._first_page(ids, pos))
            if child is None:
                break
            n = 0  # pages of child that match
            while (
                n < len(child.pages)
                and child.key[n * ps : (n + 1) * ps] == ids[pos + n * ps : pos + (n + 1) * ps]
            ):
                n += 1
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages += child.pages
            pos += n * ps
            node = child
            if pos + ps > len(ids) or n == 0:
                break
        return node, pos, pages

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut `node` after its first `n_pages` pages; returns the new upper half."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None
        upper = Node(node.key[: n_pages * ps], node.pages[:n_pages], parent)
        upper.ref, upper.last_access = node.ref, node.last_access
        parent.children[self._first_page(node.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[n_pages * ps :], node.pages[n_pages:], upper
        upper.children[self._first_page(node.key, 0)] = node
        return upper

    def match(self, ids: list[int]) -> tuple[CacheHandle, list[int]]:
        # the last prompt token is always computed, so its logits exist to sample from
        limit = (len(ids) - 1) // self.page_size * self.page_size
        node, pos, pages = self._walk(ids[:limit])
        return CacheHandle(pos, node), pages

    # -- locking -------------------------------------------------------------------------
    def lock(self, handle: CacheHandle) -> None:
        node = handle.node
        while node is not None and node is not self.root:
            if node.ref == 0:
                self._evictable -= len(node.pages)
                self._locked += len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        node = handle.node
        while node is not None and node is not self.root:
            node.ref -= 1
            assert node.ref >= 0, "radix node unlocked more often than locked"
            if node.ref == 0:
                self._evictable += len(node.pages)
                self._locked -= len(node.pages)
            node = node.parent

    # -- inserting -----------------------------------------------------------------------
    def _insert(self, ids: list[int], pages: list[int]) -> int:
        """Add `ids` (page-aligned) with their pages; returns how many leading tokens were
        already cached (the caller's pages for those are duplicates)."""
        node, pos, _ = self._walk(ids)
        if pos < len(ids):
            leaf = Node(ids[pos:], pages[pos // self.page_size :], node)
            leaf.last_access = next(self._clock)
            node.children[self._first_page(leaf.key, 0)] = leaf
            self._evictable += len(leaf.pages)
        return pos

    def donate(self, handle: CacheHandle, ids: list[int], pages: list[int]) -> list[int]:
        ps = self.page_size
        aligned = len(ids) // ps
        already = self._insert(ids[: aligned * ps], pages[:aligned])
        self.unlock(handle)
        # pages [0, cached_len) came from the tree itself; those up to `already` that the
        # request computed again duplicate tree pages; the partial tail page is not shareable
        return pages[handle.cached_len // ps : already // ps] + pages[aligned:]

    # -- evicting ------------------------------------------------------------------------
    def evict(self, num_pages: int) -> list[int]:
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < num_pages:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[self._first_page(node.key, 0)]
            freed += node.pages
            self._evictable -= len(node.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def locked_pages(self) -> int:
        return self._locked

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack += n.children.values()
        return out

    def pages(self) -> tuple[list[int], list[int]]:
        locked: list[int] = []
        unlocked: list[int] = []
        for n in self._nodes():
            (locked if n.ref > 0 else unlocked).extend(n.pages)
        assert len(locked) == self._locked and len(unlocked) == self._evictable, (
            f"radix counters drifted: locked {len(locked)} vs {self._locked}, "
            f"evictable {len(unlocked)} vs {self._evictable}"
        )
        return locked, unlocked
