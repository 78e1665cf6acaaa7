"""A running request's prompt joins the prefix cache after each piece of prompt work, not only
when it ends: requests that share a long system prompt with one still running are served from
the cache, with the same greedy tokens, and the pool accounts for every page (a page shared by a
running request and the cache counts once, shows as shared, and nothing leaks after finishes,
aborts or retractions)."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kvcache.manager import PAGE_STATES, KVManager
from engine.kvcache.radix import RadixCache
from engine.kvcache.table import PageTable
from engine.kvcache.table_sync import TableSync, apply_updates
from instrumentation.records import RequestEvent, StepRecord
from tests.helpers import Events, SchedulerSim, hf_greedy

PAGE = 4
SHARED = 250  # not a whole number of pages: a request can match 248 of it
N_REQ = 5
N_OUT = 4


def _prompts(seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(SHARED)]
    return [shared + [rng.randrange(3, 49152) for _ in range(8 + 3 * i)] for i in range(N_REQ)]


def _engine(path: object, **kw: Any) -> LLM:
    kw = {"page_size": PAGE, "max_running_req": 8, "progress": False, **kw}
    return LLM(str(path), **kw)


def _no_sharing_while_running(llm: LLM) -> None:
    """The engine as it was: a request's KV reaches the cache only when it ends."""
    llm.kv.cache_running = lambda *args: None  # type: ignore[method-assign]


def _run(
    llm: LLM,
    prompts: list[list[int]],
    n_out: int = N_OUT,
    after: Callable[[int], None] = lambda _n: None,
) -> tuple[list[dict], Events]:
    """Every prompt submitted at once and stepped to the end, the pool checked page by page
    after every step (and `after(step number)` called); per request (in prompt order) its uid,
    greedy tokens and prefix hit."""
    ev = Events()
    llm.add_event_hook(ev)
    params = SamplingParams(max_tokens=n_out, ignore_eos=True)
    uids = [llm.submit(p, params) for p in prompts]
    try:
        for n in itertools.count():
            if not llm.has_work():
                break
            llm.step()
            llm.check_integrity()
            _check_page_map(llm)
            after(n)
    finally:
        llm.remove_event_hook(ev)
    _check_idle_pool(llm)
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    for t in ev.tokens:
        tokens[t.uid].append(t.token_id)
    cached = {}
    for e in ev.requests("admitted"):
        cached.setdefault(e.uid, e.fields["cached_len"])  # the first admission's hit
    out = [{"uid": u, "token_ids": tokens[u], "cached_len": cached[u]} for u in uids]
    return out, ev


def _check_idle_pool(llm: LLM) -> None:
    """No request holds a page: every page is free or evictable, and a flush frees them all."""
    llm.check_integrity()
    st = llm.kv_stats()
    assert st.used == 0 and st.reserved == 0 and st.free + st.cached == st.total
    assert llm.kv.cache.locked_pages == 0
    assert llm.flush_cache() == st.cached
    st = llm.kv_stats()
    assert st.free == st.total and st.cached == 0


def _check_page_map(llm: LLM) -> None:
    """The page map agrees with the pool's counters: `used` pages (shared ones included) are
    the pages requests hold, each counted once."""
    m = llm.kv_map()
    count = dict.fromkeys(PAGE_STATES, 0)
    for length, state, _uid, _sharers in m["runs"]:
        count[PAGE_STATES[state]] += length
    st = llm.kv_stats()
    assert (count["free"], count["cached"], count["used"] + count["shared"]) == (
        st.free,
        st.cached,
        st.used,
    )


def _admitted_after(ev: Events) -> dict[int, int]:
    """uid -> the number of the step that admitted it (its `admitted` event follows that
    step's record)."""
    step, out = -1, {}
    for e in ev.all:
        if isinstance(e, StepRecord):
            step = e.step
        elif isinstance(e, RequestEvent) and e.event == "admitted":
            out[e.uid] = step
    return out


def _prefix_done_at(ev: Events, uid: int) -> int:
    """The step whose prompt work finished computing the shared prefix of request `uid`."""
    return next(
        s.step
        for s in ev.steps
        for it in s.items
        if it.uid == uid and it.kind != "decode" and it.end >= SHARED
    )


# -- the model: hits, greedy tokens, pages -----------------------------------------------------


@pytest.mark.parametrize("budget", [256, 100])
def test_requests_sharing_a_running_prompt_hit_the_cache(tiny_qwen3_dir, budget: int) -> None:
    """Five prompts with a 250-token system prompt in common, submitted together on a fresh
    engine: every request admitted after the first one's system prompt was computed is served
    248 tokens (the shared prompt's whole pages) from the cache, while the first still runs, and
    the greedy tokens are Hugging Face's and the engine's without sharing."""
    prompts = _prompts()
    llm = _engine(tiny_qwen3_dir, max_extend_tokens=budget)
    out, ev = _run(llm, prompts)
    ref = hf_greedy(tiny_qwen3_dir, prompts, N_OUT)
    assert [o["token_ids"] for o in out] == ref

    uids = [e.uid for e in ev.requests("queued")]
    admitted = _admitted_after(ev)
    done = _prefix_done_at(ev, uids[0])
    later = [u for u in uids[1:] if admitted[u] > done]
    assert later, "no request was admitted after the first one's prompt was computed"
    aligned = SHARED // PAGE * PAGE
    cached = {o["uid"]: o["cached_len"] for o in out}
    for u in later:
        assert cached[u] >= aligned, (u, cached)
    # the first request was still running when they matched its prompt: it had not finished
    finished = {e.uid: i for i, e in enumerate(ev.all) if getattr(e, "event", "") == "finished"}
    first_admission = min(
        i for i, e in enumerate(ev.all) if getattr(e, "event", "") == "admitted" and e.uid in later
    )
    assert finished[uids[0]] > first_admission

    # without sharing while running (the engine as it was), none of them is served anything
    base = _engine(tiny_qwen3_dir, max_extend_tokens=budget)
    _no_sharing_while_running(base)
    base_out, _ = _run(base, prompts)
    assert [o["token_ids"] for o in base_out] == ref
    assert all(o["cached_len"] == 0 for o in base_out)


def test_prompts_computed_together_are_kept_once(tiny_qwen3_dir) -> None:
    """Admitted in one step, five requests all compute the system prompt (nothing is cached
    yet); after that step, the first one's pages are the cache's and the others' duplicates
    are freed, each row now reading the cache's pages: the pool holds the prompt once, the
    page map shows those pages shared by all five, and the tokens are unchanged."""
    prompts = _prompts()
    llm = _engine(tiny_qwen3_dir, max_extend_tokens=4096, policy="mixed")
    maps: list[dict] = []
    out, _ = _run(llm, prompts, after=lambda _n: maps.append(llm.kv_map()))
    assert [o["token_ids"] for o in out] == hf_greedy(tiny_qwen3_dir, prompts, N_OUT)
    assert all(o["cached_len"] == 0 for o in out)  # nothing was computed when they came
    step0 = maps[0]  # after the step that computed every prompt
    shared_pages = SHARED // PAGE
    shared = [r for r in step0["runs"] if PAGE_STATES[r[1]] == "shared"]
    assert sum(r[0] for r in shared) == shared_pages
    assert {r[3] for r in shared} == {N_REQ}
    own = sum(-(-len(p) // PAGE) - shared_pages for p in prompts)  # each one's tail pages
    used = sum(r[0] for r in step0["runs"] if PAGE_STATES[r[1]] in ("used", "shared"))
    # one more page each at most: the first decode's page, mapped in the step that follows
    assert shared_pages + own <= used <= shared_pages + own + N_REQ


def test_remapped_rows_reach_the_other_ranks(tiny_qwen3_dir) -> None:
    """Tensor parallelism: a row whose pages were swapped for the cache's is sent to the other
    rank again, so both ranks read the same pages: the single-process engine's tokens."""
    prompts = _prompts()[:3]
    ref = hf_greedy(tiny_qwen3_dir, prompts, N_OUT)
    tp = _engine(tiny_qwen3_dir, tp_size=2, max_extend_tokens=4096, overlap=True)
    try:
        out, _ = _run(tp, prompts)
        assert sum(tp.kv.table.remaps) >= 2  # the second and third rows at least
    finally:
        tp.close()
    assert [o["token_ids"] for o in out] == ref


def test_naive_cache_shares_nothing_and_leaks_nothing(tiny_qwen3_dir) -> None:
    prompts = _prompts()[:3]
    llm = _engine(tiny_qwen3_dir, cache_type="naive", max_extend_tokens=128)
    out, _ = _run(llm, prompts)
    assert [o["token_ids"] for o in out] == hf_greedy(tiny_qwen3_dir, prompts, N_OUT)
    assert all(o["cached_len"] == 0 for o in out)


def test_overlap_shares_a_running_prompt(tiny_qwen3_dir) -> None:
    """Overlap (the next step scheduled before this one's tokens are read): the same hits and
    tokens."""
    prompts = _prompts()
    llm = _engine(tiny_qwen3_dir, max_extend_tokens=256, overlap=True)
    assert llm.overlap
    out, ev = _run(llm, prompts)
    assert [o["token_ids"] for o in out] == hf_greedy(tiny_qwen3_dir, prompts, N_OUT)
    assert any(o["cached_len"] >= SHARED // PAGE * PAGE for o in out[1:])


def test_abort_mid_prompt_and_while_sharing(tiny_qwen3_dir) -> None:
    """Aborting a request part-way through its chunks (its first chunk already in the cache),
    and one that others' rows read pages of, leaves every page free or evictable."""
    prompts = _prompts()
    # chunks of 100: the first request's third chunk is still to come after two steps
    llm = _engine(tiny_qwen3_dir, max_extend_tokens=100, overlap=True)
    uids = [llm.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    llm.step()
    llm.step()  # the first request's first chunks are launched and cached
    assert llm.kv.cache.locked_pages > 0
    # part-way through its prompt: waiting for its next chunk
    chunked = [r.chunked_req for r in llm.scheduler.waiting if r.uid == uids[0]]
    assert chunked and chunked[0] is not None and chunked[0].device_len < len(prompts[0])
    llm.abort(uids[0])
    second = False
    while llm.has_work():
        llm.step()
        llm.check_integrity()
        _check_page_map(llm)
        if not second and llm.queue_stats().running == N_REQ - 1:
            llm.abort(uids[1])  # the others' rows read the pages of its prompt
            second = True
    assert second
    _check_idle_pool(llm)


def test_retraction_keeps_tokens_and_pages(tiny_qwen3_dir) -> None:
    """Optimistic admission in a pool too small for every request's outputs: requests whose
    prompt is in the cache are retracted (their prompt stays cached, evictable) and admitted
    again, with Hugging Face's greedy tokens and no page lost."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(4 + i)] for i in range(6)]
    n_out = 40
    llm = _engine(
        tiny_qwen3_dir,
        num_pages=72,
        max_seq_len=96,
        admission="optimistic",
        max_extend_tokens=64,
        schedule_conservativeness=0.3,
        new_token_ratio_decay_steps=3,
    )
    out, _ = _run(llm, prompts, n_out)
    assert llm.num_retractions > 0
    assert [o["token_ids"] for o in out] == hf_greedy(tiny_qwen3_dir, prompts, n_out)


# -- the bookkeeping, without a model ----------------------------------------------------------


def test_insert_moves_the_lock_and_hands_back_duplicates() -> None:
    cache = RadixCache(page_size=2)
    a, _ = cache.match([1, 2, 3, 4, 5, 6, 7])
    cache.lock(a)
    assert cache.insert(a, [1, 2, 3, 4], [10, 11]) == []  # new: the cache takes its pages
    assert (a.cached_len, cache.locked_pages, cache.evictable_pages) == (4, 2, 0)
    b, pages = cache.match([1, 2, 3, 4, 9, 9, 9])
    assert (b.cached_len, pages) == (4, [10, 11])  # a running request's prompt is matched
    cache.lock(b)
    # a third request computed [1..6] itself before it could match: its first two pages are
    # duplicates of the cache's; its third is new
    c, _ = cache.match([8])
    cache.lock(c)
    assert cache.insert(c, [1, 2, 3, 4, 5, 6], [20, 21, 22]) == [10, 11]
    assert cache.locked_pages == 3 and cache.evictable_pages == 0
    assert cache.evict(10) == []  # every page is locked by a running request
    assert cache.donate(a, [1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13]) == [12, 13]
    assert cache.donate(b, [1, 2, 3, 4, 9, 9, 9], [10, 11, 30, 31]) == [31]
    assert cache.locked_pages == 3  # c holds [1..6] still
    assert sorted(cache.evict(10)) == [30]
    assert cache.donate(c, [1, 2, 3, 4, 5, 6, 7], [10, 11, 22, 23]) == [23]
    assert cache.locked_pages == 0 and sorted(cache.evict(10)) == [10, 11, 22]


def test_manager_frees_duplicates_and_remaps_the_row() -> None:
    kv = KVManager(32, 2, PageTable(4, 32, 2), RadixCache(2))
    ids = list(range(100, 110))
    rows = []
    for _ in range(2):  # both admitted before either computed anything
        admitted = kv.try_admit(ids, len(ids) + 2)
        assert not isinstance(admitted, str)
        rows.append(admitted)
    for _, row in rows:
        kv.map_upto([(row, 9)])
    free = kv.allocator.num_free
    for handle, row in rows:
        kv.cache_running(row, handle, ids, 9)  # 8 tokens in whole pages
        kv.check_integrity([r for _, r in rows])
    (ha, ra), (hb, rb) = rows
    assert kv.table.pages_of(ra, 0, 8) == kv.table.pages_of(rb, 0, 8)
    assert kv.allocator.num_free == free + 4  # the second row's four duplicates
    assert kv.table.remaps[rb] == 1 and kv.table.remaps[ra] == 0
    assert kv.cache.locked_pages == 4
    owners = {ra: 1, rb: 2}
    runs = kv.page_map(owners, 0).runs
    assert [r for r in runs if PAGE_STATES[r[1]] == "shared"][0][::3] == [4, 2]
    active = [ra, rb]
    for handle, row in rows:
        kv.release(row, handle, ids[:9])
        active.remove(row)
        kv.check_integrity(active)
    assert kv.cache.locked_pages == 0 and kv.cache.evictable_pages == 4
    assert kv.allocator.num_free == 28


def test_own_prompt_pages_show_as_the_requests_own() -> None:
    """A page only its computing request maps is that request's in the page map (`used`), even
    though the cache now holds it; a radix hit is `shared`."""
    kv = KVManager(16, 2, PageTable(2, 16, 2), RadixCache(2))
    ids = list(range(50, 57))
    admitted = kv.try_admit(ids, 8)
    assert not isinstance(admitted, str)
    handle, row = admitted
    kv.map_upto([(row, 7)])
    kv.cache_running(row, handle, ids, 7)
    assert kv.cache.locked_pages == 3
    runs = kv.page_map({row: 9}, 0).runs
    assert {PAGE_STATES[r[1]] for r in runs} == {"used", "free"}
    hit = kv.try_admit(ids[:6] + [1, 2], 9)
    assert not isinstance(hit, str) and hit[0].cached_len == 6
    runs = kv.page_map({row: 9, hit[1]: 10}, 0).runs
    assert [r[0] for r in runs if PAGE_STATES[r[1]] == "shared"] == [3]


def test_tables_of_other_ranks_follow_a_remap() -> None:
    table, copy, sync = PageTable(2, 16, 2), PageTable(2, 16, 2), TableSync()
    req = type("R", (), {"tenancy": (1, 0), "table_idx": 0, "device_len": 6})()
    table.map_pages(0, 0, [3, 4, 5])
    apply_updates(copy, *sync.updates([req], table))
    table.remap(0, 0, [7, 8])  # its first two pages turned out to be the cache's 7 and 8
    req.device_len = 7
    apply_updates(copy, *sync.updates([req], table))
    assert torch.equal(copy.slots[0, :7], table.slots[0, :7])


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_a_long_shared_prompt_leaks_nothing(seed: int) -> None:
    """Bookkeeping only: many requests on a common prompt, chunked under small budgets,
    optimistic admission in a small pool (retractions), random EOS; after every step the pool
    adds up page by page and the page map agrees; at the end every page is free or cached."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4])
    sim = SchedulerSim(160 // page_size, page_size, 6, 96, "radix", seed)
    kv, sched = sim.kv, sim.scheduler
    shared = [rng.randrange(3, 999) for _ in range(40)]
    hits = 0
    for step in range(300):
        for _ in range(rng.choice([0, 0, 1, 2]) if step < 200 else 0):
            prompt = shared[: rng.randrange(20, 41)] + [rng.randrange(3, 999) for _ in range(3)]
            sim.submit(prompt, rng.randrange(1, 96 - len(prompt) + 1))
        sim.step(rng.choice(["prefill_first", "mixed"]), rng.choice([3, 7, 16]), 0.05, "optimistic")
        kv.check_integrity(sched.active_rows())
        sched.check_counters()
        owners = {r: r for r in sched.active_rows()}
        st = kv.stats(0)
        counts = dict.fromkeys(PAGE_STATES, 0)
        for length, state, _uid, _n in kv.page_map(owners, 0).runs:
            counts[PAGE_STATES[state]] += length
        assert counts["used"] + counts["shared"] == st.used and counts["cached"] == st.cached
        hits += sum(1 for r in sched.running if r.state.cached_len > 0)
    while sched.has_work():
        sim.step("mixed", 16, 0.0, "optimistic")
    kv.check_integrity([])
    st = kv.stats(0)
    assert st.used == 0 and st.free + st.cached == st.total
    assert kv.flush_cache() == st.cached and kv.allocator.num_free == kv.num_pages
    assert hits > 0 and sched.num_retractions > 0


def test_the_shared_system_prompt_preset_is_served_from_the_cache(tiny_llama_dir) -> None:
    """The page's "Shared system prompt" preset, played as the page plays it on a fresh engine
    (the first question, its first token, then the other four): every request after the first
    reuses the system prompt's whole pages while the first is still decoding."""
    from app.workloads import PRESETS_BY_KEY, AwaitTokens, Submit

    llm = LLM(model=str(tiny_llama_dir), max_seq_len=1024, progress=False)
    ev = Events()
    llm.add_event_hook(ev)
    uids: list[int] = []
    for action in PRESETS_BY_KEY["shared"].actions:
        if isinstance(action, Submit):
            params = SamplingParams(max_tokens=action.max_tokens, ignore_eos=True)
            uids.append(llm.submit(action.prompt, params, chat=action.chat))
        elif isinstance(action, AwaitTokens):
            while len([t for t in ev.tokens if t.uid in uids]) < action.tokens * len(uids):
                llm.step()
    while llm.has_work():
        llm.step()
    prompts = {e.uid: e.fields["prompt_len"] for e in ev.requests("queued")}
    ids = [llm.encode(a.prompt) for a in PRESETS_BY_KEY["shared"].actions if isinstance(a, Submit)]
    shared = len(os.path.commonprefix(ids))
    assert shared >= 400 and all(prompts[u] > shared for u in uids)
    cached = {e.uid: e.fields["cached_len"] for e in ev.requests("admitted")}
    aligned = shared // llm.page_size * llm.page_size
    assert cached[uids[0]] == 0
    assert all(cached[u] >= aligned for u in uids[1:]), (cached, aligned)
    # the first was still running when the others were admitted: shared while running
    ended = {e.uid for e in ev.requests("finished")}
    assert ended == set(uids)
    llm.check_integrity()
