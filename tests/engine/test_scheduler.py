"""The chapter's scheduling properties and the mixed policy, checked from step records."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from instrumentation.errors import NotFound
from instrumentation.records import StepRecord
from tests.helpers import Events, SchedulerSim, hf_greedy


@pytest.fixture
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), cache_type="naive", max_running_req=8, progress=False)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def _prompt_steps(steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if s.phase != "decode"]


def test_chapter_properties_at_small_budget(llm: LLM) -> None:
    rng = random.Random(0)
    prompts = [_ids(rng, 61), _ids(rng, 5), _ids(rng, 5), _ids(rng, 23)]
    ev = Events()
    llm.add_event_hook(ev)
    llm.set_config(max_extend_tokens=6)
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))

    prefill = _prompt_steps(ev.steps)
    sizes = [s.prompt_tokens for s in prefill]
    # every prefill step but the last uses exactly its budget
    assert all(n == 6 for n in sizes[:-1]) and 0 < sizes[-1] <= 6
    assert all(s.phase == "prefill" for s in prefill)  # prefill-first: one kind per step
    # every prompt token is computed exactly once, in order
    computed: dict[int, list[tuple[int, int]]] = {}
    for s in prefill:
        for it in s.items:
            computed.setdefault(it.uid, []).append((it.start, it.end))
    uids = sorted(computed)
    for uid, prompt in zip(uids, prompts, strict=True):
        spans = computed[uid]
        assert spans[0][0] == 0 and spans[-1][1] == len(prompt)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert sum(sizes) == sum(map(len, prompts))

    # chunk items are never sampled: the tokens after a step come only from its other items
    current: StepRecord | None = None
    for e in ev.all:
        if isinstance(e, StepRecord):
            current = e
        elif e.__class__.__name__ == "TokenEvent":
            assert current is not None
            kinds = {it.uid: it.kind for it in current.items}
            assert kinds[e.uid] in ("prefill", "decode")

    # an unfinished chunked request continues first on the next step
    for a, b in zip(prefill, prefill[1:], strict=False):
        last = a.items[-1]
        if last.kind == "chunk":
            first = b.items[0]
            assert (first.uid, first.start) == (last.uid, last.end)
            assert a.step + 1 == b.step  # nothing ran in between


def test_budget_one_is_slow_but_correct(tiny_llama_dir, llm: LLM) -> None:
    prompt = _ids(random.Random(5), 12)
    ev = Events()
    llm.add_event_hook(ev)
    llm.set_config(max_extend_tokens=1)
    out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [s.prompt_tokens for s in _prompt_steps(ev.steps)] == [1] * 12
    assert out[0]["token_ids"] == hf_greedy(tiny_llama_dir, [prompt], 4)[0]


def _start_chats(llm: LLM, n: int, max_tokens: int, rng: random.Random) -> list[int]:
    uids = [
        llm.submit(_ids(rng, 4), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for _ in range(n)
    ]
    while llm.queue_stats().running < n or llm.scheduler.waiting:
        llm.step()
    return uids


def test_prefill_first_stalls_decode_while_chunking(llm: LLM) -> None:
    rng = random.Random(1)
    llm.set_config(max_extend_tokens=8, policy="prefill_first")
    chats = _start_chats(llm, 3, 40, rng)
    ev = Events()
    llm.add_event_hook(ev)
    long_uid = llm.submit(_ids(rng, 60), SamplingParams(max_tokens=2, ignore_eos=True))
    while not any(it.uid == long_uid and it.kind == "prefill" for s in ev.steps for it in s.items):
        llm.step()
    steps = ev.steps
    # 60 tokens at 8 a step: 8 consecutive steps with no decode item at all
    assert [s.phase for s in steps] == ["prefill"] * 8
    assert all(it.uid == long_uid for s in steps for it in s.items)
    assert not any(it.kind == "decode" for s in steps for it in s.items)
    assert set(chats) <= {it.uid for it in llm.step().items}  # decode resumes after


def test_mixed_decodes_every_running_request_every_step(tiny_llama_dir) -> None:
    llm = LLM(
        str(tiny_llama_dir), max_running_req=8, policy="mixed", max_extend_tokens=8, progress=False
    )
    rng = random.Random(2)
    ev = Events()
    llm.add_event_hook(ev)
    prompts = [_ids(rng, 4) for _ in range(3)] + [_ids(rng, 60)]
    uids = [llm.submit(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[:3]]
    for _ in range(2):
        llm.step()
    long_uid = llm.submit(prompts[3], SamplingParams(max_tokens=4, ignore_eos=True))
    while llm.has_work():
        llm.step()
    running: set[int] = set()
    mixed_steps = 0
    for s in ev.steps:
        in_step = {it.uid for it in s.items}
        assert running <= in_step, f"step {s.step} left out decoding requests {running - in_step}"
        decodes = sum(it.kind == "decode" for it in s.items)
        assert s.prompt_tokens <= max(0, s.budget - decodes)
        mixed_steps += s.phase == "mixed"
        for it in s.items:
            if it.kind in ("prefill", "decode"):
                running.add(it.uid)
        running -= {e.uid for e in ev.requests("finished") if e.t <= s.t1}
    assert mixed_steps >= 60 // 5  # the long prompt was chunked alongside decodes
    # mixing changes the order of work, never the result
    outs = {e.uid: e for e in ev.requests("finished")}
    assert set(outs) == {*uids, long_uid}
    ref = hf_greedy(tiny_llama_dir, prompts, 30)
    toks: dict[int, list[int]] = {}
    for t in ev.tokens:
        toks.setdefault(t.uid, []).append(t.token_id)
    for uid, p_ref in zip([*uids, long_uid], ref, strict=True):
        assert toks[uid] == p_ref[: len(toks[uid])]


def test_mixed_decodes_use_the_whole_budget(tiny_llama_dir) -> None:
    llm = LLM(
        str(tiny_llama_dir), max_running_req=8, policy="mixed", max_extend_tokens=3, progress=False
    )
    rng = random.Random(3)
    _start_chats(llm, 3, 12, rng)
    late = llm.submit(_ids(rng, 5), SamplingParams(max_tokens=2, ignore_eos=True))
    rec = llm.step()
    # three decodes use the whole budget: no prompt work this step, the late prompt waits
    assert rec is not None and rec.phase == "decode" and rec.num_decodes == 3
    assert late not in {it.uid for it in rec.items}
    while llm.has_work():
        llm.step()
    llm.check_integrity()


def test_live_budget_and_policy_change_mid_chunk(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), max_running_req=8, max_extend_tokens=4, progress=False)
    rng = random.Random(4)
    chat = _ids(rng, 3)
    long = _ids(rng, 50)
    ev = Events()
    llm.add_event_hook(ev)
    llm.submit(chat, SamplingParams(max_tokens=20, ignore_eos=True))
    llm.step()
    uid = llm.submit(long, SamplingParams(max_tokens=5, ignore_eos=True))
    llm.step()
    before = llm.step()
    assert before is not None and before.items[-1].kind == "chunk" and before.budget == 4
    llm.set_config(max_extend_tokens=9)
    after = llm.step()
    assert after is not None and after.budget == 9 and after.phase == "prefill"
    assert after.items[0].uid == uid and after.items[0].start == before.items[-1].end
    assert after.prompt_tokens == 9
    llm.set_config(policy="mixed", max_extend_tokens=5)
    nxt = llm.step()
    assert nxt is not None and nxt.policy == "mixed" and nxt.budget == 5 and nxt.phase == "mixed"
    assert nxt.items[-1].uid == uid and nxt.prompt_tokens == 4  # one decode used a token
    while llm.has_work():
        llm.step()
    toks: dict[int, list[int]] = {}
    for t in ev.tokens:
        toks.setdefault(t.uid, []).append(t.token_id)
    ref = hf_greedy(tiny_llama_dir, [chat, long], 20)
    assert toks[0] == ref[0] and toks[uid] == ref[1][:5]


# -- the O(1) counters: always what a scan of the queues gives --------------------------------


def _random_prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    """Half the prompts extend a shared stem, so the radix cache matches, splits and evicts."""
    tail = _ids(rng, rng.randrange(1, 40))
    return rng.choice(stems)[: rng.randrange(0, 33)] + tail if rng.random() < 0.5 else tail


@pytest.mark.parametrize(("cache_type", "page_size"), [("radix", 1), ("radix", 4), ("naive", 4)])
def test_counters_equal_a_scan_after_random_traffic(cache_type: str, page_size: int) -> None:
    # a pool of 96 tokens for up to 6 rows: admissions fail and cached prefixes are evicted
    sim = SchedulerSim(96 // page_size, page_size, max_running_req=6, max_seq_len=128,
                       cache_type=cache_type, seed=11)  # fmt: skip
    sch, kv = sim.scheduler, sim.kv
    rng = random.Random(5)
    stems = [_ids(rng, 32) for _ in range(3)]
    live: list[int] = []
    aborted_chunks = 0
    for op in range(1500):
        roll = rng.random()
        if roll < 0.22:
            live.append(sim.submit(_random_prompt(rng, stems), rng.randrange(1, 12)))
        elif roll < 0.3 and live:
            # the queue's head is often part-way through its chunks; or a running one; or any
            heads = [sch.waiting[0].uid] if sch.waiting else []
            running = [r.uid for r in sch.running]
            pick = rng.choice([heads, running, live]) or live
            uid = rng.choice(pick)
            aborted_chunks += bool(heads and uid == heads[0] and sch.waiting[0].chunked_req)
            sch.abort(uid)  # one that has ended already: a no-op
        else:
            sim.step(rng.choice(["prefill_first", "mixed"]), rng.choice([1, 3, 8, 64]), 0.05)
        sch.check_counters()  # num_waiting, num_running, reserved == a scan of the queues
        kv.check_counters()  # free + locked + cached + private == the pool
        if op % 50 == 0:
            kv.check_integrity(sch.active_rows())  # and page by page
    assert aborted_chunks >= 5  # the traffic did reach the rare transitions
    while sim.step(budget=16):
        sch.check_counters()
    assert (sch.num_waiting, sch.num_running, sch.reserved_tokens()) == (0, 0, 0)
    kv.check_integrity(sch.active_rows())
    assert kv.stats(0).used == 0 and kv.outstanding == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_counters_under_submits_aborts_and_config_changes(tiny_llama_dir, overlap) -> None:
    llm = LLM(str(tiny_llama_dir), max_running_req=4, num_pages=160, max_seq_len=96,
              overlap=overlap, progress=False)  # fmt: skip
    rng = random.Random(6)
    stems = [_ids(rng, 32) for _ in range(2)]
    uids: list[int] = []
    for _ in range(80):  # the model-free test above runs the long random walks
        for _ in range(rng.choice([0, 0, 1, 2])):
            uids.append(llm.submit(_random_prompt(rng, stems),
                                   SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True)))  # fmt: skip
        if uids and rng.random() < 0.1:
            try:
                llm.abort(uids.pop(rng.randrange(len(uids))))
            except NotFound:
                pass  # it has ended
        if rng.random() < 0.1:
            llm.set_config(max_extend_tokens=rng.choice([1, 4, 16, 64]),
                           policy=rng.choice(["prefill_first", "mixed"]))  # fmt: skip
        llm.step()
        llm.check_integrity()  # counters == scan, and every page accounted for
        q = llm.queue_stats()
        assert (q.waiting, q.running) == (llm.scheduler.recount().num_waiting,
                                          llm.scheduler.recount().num_running)  # fmt: skip
    while llm.has_work():
        llm.step()
    llm.check_integrity()
    st = llm.kv_stats()
    q = llm.queue_stats()
    assert (st.used, st.reserved, q.waiting, q.running) == (0, 0, 0, 0)
