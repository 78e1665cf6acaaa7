"""Prefix reuse through the radix cache, and the radix tree's own bookkeeping."""

from __future__ import annotations

import heapq
import random

import pytest

from engine import LLM, SamplingParams
from engine.kvcache.manager import KVManager
from engine.kvcache.prefix import CacheHandle
from engine.kvcache.radix import Node, RadixCache
from engine.kvcache.table import PageTable
from tests.helpers import Events, hf_greedy


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_is_computed_once(tiny_qwen3_dir, page_size: int) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 49152) for _ in range(100)]
    a = prefix + [rng.randrange(3, 49152) for _ in range(20)]
    b = prefix + [rng.randrange(3, 49152) for _ in range(15)]
    llm = LLM(str(tiny_qwen3_dir), page_size=page_size, max_extend_tokens=32, progress=False)
    ev = Events()
    llm.add_event_hook(ev)
    out_a = llm.generate([a], SamplingParams(max_tokens=6, ignore_eos=True))
    ev.clear()
    out_b = llm.generate([b], SamplingParams(max_tokens=6, ignore_eos=True))

    admitted = ev.requests("admitted")[0]
    assert admitted.fields["cached_len"] == 100  # 100 is a multiple of both page sizes
    computed = sum(it.num_tokens for s in ev.steps for it in s.items if it.kind != "decode")
    assert computed == len(b) - 100
    first = next(s for s in ev.steps if s.phase == "prefill")
    assert first.items[0].start == 100
    assert out_b[0]["cached_len"] == 100
    ref = hf_greedy(tiny_qwen3_dir, [a, b], 6)
    assert [out_a[0]["token_ids"], out_b[0]["token_ids"]] == ref
    llm.check_integrity()


def test_full_match_still_computes_the_last_token(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), progress=False)
    prompt = list(range(100, 140))
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    ev = Events()
    llm.add_event_hook(ev)
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    first = ev.steps[0]
    assert [(it.kind, it.start, it.end) for it in first.items] == [("prefill", 39, 40)]


def test_radix_match_split_lock_evict() -> None:
    cache = RadixCache(page_size=2)
    h0, _ = cache.match([1, 2, 3, 4, 5])
    assert h0.cached_len == 0
    # insert [1..6] on pages 10,11,12; then a sibling sharing the first page
    assert cache.donate(h0, [1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13]) == [13]
    h1, pages = cache.match([1, 2, 3, 4, 9, 9, 9])
    assert (h1.cached_len, pages) == (4, [10, 11])  # matched inside a node: split at a page
    cache.lock(h1)
    assert cache.evictable_pages == 1 and cache.locked_pages == 2
    assert sorted(cache.evict(10)) == [12]  # only the unlocked tail can go
    assert cache.evict(10) == []
    freed = cache.donate(h1, [1, 2, 3, 4, 9, 9, 9], [10, 11, 20, 21])
    assert freed == [21]  # pages 10, 11 are the tree's own; page 20 is now cached
    assert cache.evictable_pages == 3 and cache.locked_pages == 0
    locked, unlocked = cache.pages()
    assert locked == [] and sorted(unlocked) == [10, 11, 20]


def test_radix_duplicate_insert_returns_duplicate_pages() -> None:
    cache = RadixCache(page_size=1)
    h, _ = cache.match([5, 6, 7])
    assert cache.donate(h, [5, 6, 7], [0, 1, 2]) == []
    # a second request computed the same tokens on its own pages before the first finished
    h2 = cache.match([9])[0]
    assert cache.donate(h2, [5, 6, 7, 8], [3, 4, 5, 6]) == [3, 4, 5]


def test_eviction_under_pressure_keeps_integrity(tiny_llama_dir) -> None:
    # a pool barely larger than one request: every new prompt must evict cached pages
    llm = LLM(str(tiny_llama_dir), num_pages=64, max_seq_len=64, progress=False)
    rng = random.Random(9)
    for _ in range(6):
        llm.generate(
            [[rng.randrange(3, 49152) for _ in range(40)]],
            SamplingParams(max_tokens=8, ignore_eos=True),
        )
        llm.check_integrity()
        st = llm.kv_stats()
        assert st.used == 0 and st.cached + st.free == st.total


# -- eviction without walking the tree; admission that fails changes nothing ------------------


def _tree(cache: RadixCache) -> list[tuple]:
    """Everything eviction depends on: each node's tokens, pages, locks and access time."""
    return sorted(
        (tuple(n.key), tuple(n.pages), n.ref, n.last_access, id(n.parent)) for n in cache._nodes()
    )


def _lru_by_walk(cache: RadixCache) -> list[Node]:
    """The order the old algorithm (walk the whole tree, heapify its unlocked leaves) evicts in;
    a parent becomes a candidate once its last child is gone."""
    leaves = [
        (n.last_access, n.pages[0], n) for n in cache._nodes() if not n.children and not n.ref
    ]
    heapq.heapify(leaves)
    order: list[Node] = []
    while leaves:
        node = heapq.heappop(leaves)[2]
        order.append(node)
        parent = node.parent
        assert parent is not None
        if parent is not cache.root and not parent.ref:
            if all(c in order for c in parent.children.values()):
                heapq.heappush(leaves, (parent.last_access, parent.pages[0], parent))
    return order


def test_radix_evicts_in_lru_order_like_a_full_walk() -> None:
    rng = random.Random(3)
    stems = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(4)]
    for page_size in (1, 2, 4):
        cache = RadixCache(page_size)
        next_page = 0
        held: list[tuple[CacheHandle, list[int], list[int]]] = []  # requests still running
        for _ in range(400):
            tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))]
            ids = rng.choice(stems)[: rng.randrange(0, 25)] + tail
            handle, pages = cache.match(ids)
            cache.lock(handle)
            fresh = -(-len(ids) // page_size) - len(pages)  # pages for the rest of the prompt
            held.append((handle, ids, pages + list(range(next_page, next_page + fresh))))
            next_page += fresh
            if len(held) > 3 or rng.random() < 0.5:  # one ends: its KV goes to the tree
                cache.donate(*held.pop(rng.randrange(len(held))))
            if rng.random() < 0.3:
                want, n = _lru_by_walk(cache), rng.randrange(1, 6)
                expected: list[int] = []
                for node in want:
                    if len(expected) >= n:
                        break
                    expected += node.pages
                assert cache.evict(n) == expected
            _, unlocked = cache.pages()
            assert len(unlocked) == cache.evictable_pages
            assert len(cache._heap) <= 2 * cache.num_nodes + 64  # stale entries are pruned
        while held:
            cache.donate(*held.pop())
        want = _lru_by_walk(cache)
        assert cache.evict(10**6) == [p for node in want for p in node.pages]
        assert cache.num_nodes == cache.evictable_pages == cache.locked_pages == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_failed_admission_leaves_the_tree_and_lru_order_untouched(page_size: int) -> None:
    kv = KVManager(64 // page_size, page_size, PageTable(4, 64, page_size), RadixCache(page_size))
    cache = kv.cache
    assert isinstance(cache, RadixCache)
    rng = random.Random(4)
    a = [rng.randrange(3, 500) for _ in range(24)]
    b = a[:8] + [rng.randrange(3, 500) for _ in range(16)]
    for ids in (a, b):  # two cached prompts sharing 8 tokens, both unlocked
        admitted = kv.try_admit(ids, len(ids) + 1)  # promise the prompt and one token
        assert not isinstance(admitted, str)
        handle, row = admitted
        kv.map_upto([(row, len(ids))])
        kv.release(row, handle, ids)

    def state() -> tuple:
        lru = [id(n) for n in cache.lru_order()]
        counts = (cache.evictable_pages, cache.locked_pages, kv.allocator.num_free, kv.outstanding)
        return _tree(cache), lru, counts

    before = state()
    # this matches 12 tokens of `a`: locking them would split a node and touch its path; but
    # 12 + 60 tokens cannot fit in a 64-token pool, so the admission fails and changes nothing
    assert kv.try_admit(a[:12] + [7] * 4, 16 + 60) == "kv"
    assert state() == before
    kv.check_integrity([])
    admitted = kv.try_admit(a[:12] + [7] * 4, 16 + 4)  # smaller, it fits: the node is split
    assert not isinstance(admitted, str) and admitted[0].cached_len == 12
    assert len(cache._nodes()) == len(before[0]) + 1
    kv.check_integrity([admitted[1]])
