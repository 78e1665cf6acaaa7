"""RadixCache: a radix tree of page-aligned token runs and the KV pages that hold them.

Requests lock the path they matched (reference counts up to the root). A running request's
computed whole pages are inserted after each piece of prompt work (`insert`), and its lock moves
down to cover them, so a request admitted later matches a prefix that is still being decoded
from; what a request computed that the tree already holds is handed back as duplicates.
Unlocked leaves are evicted least recently used first when the pool needs pages.

Eviction keeps a heap of candidate leaves keyed by last access, with lazy invalidation: an entry
is pushed whenever a node becomes an unlocked leaf or is touched while it is one, and an entry
whose node has since been locked, grown a child, been touched again or been evicted is skipped
when popped. A shortage therefore costs O(log n) per evicted leaf, not a walk of the tree. The
heap is rebuilt from its live entries when stale ones outnumber the nodes, so it stays O(nodes).
"""

from __future__ import annotations

import heapq
import itertools

from engine.kvcache.prefix import CacheHandle, PrefixCache


class Node:
    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: Node | None) -> None:
        self.key = key  # tokens, len(key) == len(pages) * page_size
        self.pages = pages  # never changed in place (split rebinds), so snapshots can share it
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent  # None for the root and for evicted nodes
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
        self._num_nodes = 0  # every node but the root
        self._heap: list[tuple[int, int, Node]] = []  # (last_access, tie-break, leaf)
        self._tie = itertools.count()

    # -- matching ------------------------------------------------------------------------
    def _first_page(self, ids: list[int], at: int) -> tuple[int, ...]:
        return tuple(ids[at : at + self.page_size])

    def _find(
        self, ids: list[int], node: Node | None = None, pos: int = 0
    ) -> tuple[Node, int, int, list[int]]:
        """Deepest node whose path is a prefix of `ids`, without changing anything, searching
        below `node` (the root by default), whose path is `ids[:pos]`: returns it, how many of
        its pages matched when the match ends inside it (0: all of them), the matched length
        and the matched pages past `pos`."""
        ps, pages = self.page_size, []
        node = self.root if node is None else node
        while pos + ps <= len(ids):
            child = node.children.get(self._first_page(ids, pos))
            if child is None:
                break
            n = 1  # its first page is the key it was found under
            while (
                n < len(child.pages)
                and child.key[n * ps : (n + 1) * ps] == ids[pos + n * ps : pos + (n + 1) * ps]
            ):
                n += 1
            pos += n * ps
            if n < len(child.pages):
                return child, n, pos, pages + child.pages[:n]
            pages += child.pages
            node = child
        return node, 0, pos, pages

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
        self._num_nodes += 1
        return upper  # the lower half keeps its identity, so its heap entry stays valid

    def match(self, ids: list[int]) -> tuple[CacheHandle, list[int]]:
        # the last prompt token is always computed, so its logits exist to sample from
        limit = (len(ids) - 1) // self.page_size * self.page_size
        node, split_at, pos, pages = self._find(ids[:limit])
        return CacheHandle(pos, node, split_at), pages

    # -- locking -------------------------------------------------------------------------
    def pages_to_lock(self, handle: CacheHandle) -> int:
        node, n = handle.node, 0
        if handle.split_at:  # only the matched head of this node will be locked
            n += handle.split_at if node.ref == 0 else 0
            node = node.parent
        while node is not None and node is not self.root:
            n += len(node.pages) if node.ref == 0 else 0
            node = node.parent
        return n

    def lock(self, handle: CacheHandle) -> None:
        if handle.split_at:
            handle.node, handle.split_at = self._split(handle.node, handle.split_at), 0
        now = next(self._clock)
        node = handle.node
        while node is not None and node is not self.root:
            node.last_access = now  # locked nodes are not in the heap until unlocked
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
                self._offer(node)
            node = node.parent

    # -- inserting -----------------------------------------------------------------------
    def _insert(
        self, ids: list[int], pages: list[int], node: Node, start: int
    ) -> tuple[Node, int, list[int]]:
        """Add `ids` (page-aligned) below `node`, whose path is `ids[:start]`; `pages` hold the
        KV of `ids[start:]`. Returns the node whose path is all of `ids`, how many leading
        tokens were cached already and the cache's pages for `ids[start:that]` (the caller's
        pages for those are duplicates)."""
        node, split_at, pos, matched = self._find(ids, node, start)
        if split_at:
            node = self._split(node, split_at)
        now = next(self._clock)
        path: Node | None = node
        while path is not None:
            path.last_access = now
            path = path.parent
        if pos < len(ids):
            leaf = Node(ids[pos:], pages[(pos - start) // self.page_size :], node)
            leaf.last_access = next(self._clock)
            node.children[self._first_page(leaf.key, 0)] = leaf
            self._evictable += len(leaf.pages)
            self._num_nodes += 1
            self._offer(leaf)
            node = leaf
        else:
            self._offer(node)  # touched: if it is an unlocked leaf, its place in the LRU moved
        return node, pos, matched

    def insert(self, handle: CacheHandle, ids: list[int], pages: list[int]) -> list[int]:
        start = handle.cached_len
        old = handle.node
        node, _, matched = self._insert(ids, pages, old, start)
        # the request already holds the path down to `old`: lock only the nodes below it
        below: Node | None = node
        while below is not old:
            assert below is not None, "the handle's node is not on the inserted path"
            if below.ref == 0:
                self._evictable -= len(below.pages)
                self._locked += len(below.pages)
            below.ref += 1
            below = below.parent
        handle.cached_len, handle.node, handle.split_at = len(ids), node, 0
        return matched

    def donate(self, handle: CacheHandle, ids: list[int], pages: list[int]) -> list[int]:
        ps = self.page_size
        aligned, start = len(ids) // ps, handle.cached_len // ps
        # the locked path already holds ids[:cached_len]: insert below it
        _, already, _ = self._insert(
            ids[: aligned * ps], pages[start:aligned], handle.node, handle.cached_len
        )
        self.unlock(handle)
        # pages [0, cached_len) came from the tree itself; those up to `already` that the
        # request computed again duplicate tree pages; the partial tail page is not shareable
        return pages[start : already // ps] + pages[aligned:]

    # -- evicting ------------------------------------------------------------------------
    def _evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.ref == 0

    def _offer(self, node: Node) -> None:
        """Push `node` as an eviction candidate if it is one now (at its current access time)."""
        if not self._evictable_leaf(node):
            return
        heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._compact()

    def _compact(self) -> None:
        live: dict[int, tuple[int, int, Node]] = {}
        for entry in self._heap:
            if self._current(entry):
                live[id(entry[2])] = entry  # a node offered twice at one access time: once
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def _current(self, entry: tuple[int, int, Node]) -> bool:
        stamp, _, node = entry
        return node.last_access == stamp and self._evictable_leaf(node)

    def evict(self, num_pages: int) -> list[int]:
        freed: list[int] = []
        while self._heap and len(freed) < num_pages:
            entry = heapq.heappop(self._heap)
            if not self._current(entry):
                continue  # stale: locked, grown, touched again or already evicted
            node = entry[2]
            parent = node.parent
            assert parent is not None
            del parent.children[self._first_page(node.key, 0)]
            node.parent = None
            freed += node.pages
            self._evictable -= len(node.pages)
            self._num_nodes -= 1
            if parent is not self.root:
                self._offer(parent)
        return freed

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def locked_pages(self) -> int:
        return self._locked

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack += n.children.values()
        return out

    def lru_order(self) -> list[Node]:
        """The unlocked leaves in the order `evict` would take them (for tests)."""
        order: dict[int, Node] = {}
        for entry in sorted(self._heap, key=lambda e: e[:2]):
            if self._current(entry):
                order.setdefault(id(entry[2]), entry[2])
        return list(order.values())

    def page_runs(self) -> list[tuple[bool, list[int]]]:
        return [(n.ref > 0, n.pages) for n in self._nodes()]
