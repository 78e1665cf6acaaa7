"""Optimistic admission and retraction: a pool small enough that
decode runs out of pages again and again, and still every request's greedy tokens equal the same
request's under `reserve` and Hugging Face's, whatever the budget, policy or overlap; random
traffic with admission switched mid-run leaks no page and keeps every counter equal to a scan."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.scheduler.admission import NewTokenRatio
from instrumentation.errors import InvalidRequest
from instrumentation.records import RequestEvent, StepRecord, TokenEvent
from tests.helpers import Events, SchedulerSim, hf_greedy

# one worker runs the module: its fixture `runs` (Hugging Face's tokens and every engine run) is
# made once, not by each worker that gets one of its tests
pytestmark = pytest.mark.xdist_group("admission_runs")

N_REQ = 16
POOL = 44  # pages of one token: about two requests' worth, for 16 requests of up to 40 tokens
# SGLang's knobs, turned down so that the estimate trusts the pool again soon after a
# retraction: each crunch retracts a few requests, and there are many crunches
PRESSURE = dict(schedule_conservativeness=0.3, new_token_ratio_decay_steps=3)
RUNS = [(7, "prefill_first"), (7, "mixed"), (512, "prefill_first"), (512, "mixed")]


def _workload(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 9))] for _ in range(N_REQ)]
    outputs = [rng.randrange(20, 33) for _ in range(N_REQ)]
    return prompts, outputs


def _llm(path: object, admission: str, **kw: object) -> LLM:
    return LLM(
        str(path), num_pages=POOL, max_running_req=16, max_seq_len=64, admission=admission,
        progress=False, **PRESSURE, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _generate(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[list, Events]:
    """Token ids per request and every event, checking the pool after every step."""
    ev = Events()

    def check(rec: StepRecord) -> None:
        kv = rec.kv
        assert kv.used + kv.cached + kv.free == kv.total
        llm.scheduler.check_counters()

    llm.add_event_hook(ev)
    llm.add_step_hook(check)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in outputs]
    out = llm.generate(prompts, params)
    llm.remove_event_hook(ev)
    llm.hooks.step.remove(check)
    llm.check_integrity()
    assert llm.kv_stats().used == 0 and llm.kv_stats().reserved == 0
    return [o["token_ids"] for o in out], ev


@pytest.fixture(scope="module")
def runs(tiny_llama_dir) -> dict:
    """HF's tokens, `reserve`'s, and each (budget, policy) run under `optimistic`."""
    prompts, outputs = _workload()
    # each request's own length: 26 tokens on average, not 32 for all (greedy runs are prefixes)
    hf = [hf_greedy(tiny_llama_dir, [p], n)[0] for p, n in zip(prompts, outputs, strict=True)]
    out: dict = {"prompts": prompts, "hf": hf}
    out["reserve"] = _generate(_llm(tiny_llama_dir, "reserve"), prompts, outputs)
    llm = _llm(tiny_llama_dir, "optimistic")
    for budget, policy in RUNS:
        llm.set_config(max_extend_tokens=budget, policy=policy)
        out[budget, policy] = _generate(llm, prompts, outputs)
    return out


def test_reserve_never_retracts(runs) -> None:
    tokens, ev = runs["reserve"]
    assert tokens == runs["hf"]
    assert not ev.requests("retracted") and not any(s.retracted for s in ev.steps)


@pytest.mark.parametrize("budget, policy", RUNS)
def test_retraction_keeps_every_greedy_token(runs, budget: int, policy: str) -> None:
    tokens, ev = runs[budget, policy]
    retracted = ev.requests("retracted")
    # the pool runs out again and again (20-24 retractions in each run): room below that
    assert len(retracted) == sum(len(s.retracted) for s in ev.steps) >= 10
    recompute = [i for s in ev.steps for i in s.items if i.kind == "recompute"]
    assert recompute and all(i.num_tokens <= budget for i in recompute)
    assert tokens == runs["reserve"][0] == runs["hf"]


def test_retraction_under_overlap(tiny_llama_dir, runs) -> None:
    """Overlap: a request retracted while its last token is still being sampled gets that token,
    and is recomputed with it once it is read."""
    prompts, outputs = _workload()
    llm = _llm(tiny_llama_dir, "optimistic", overlap=True, max_extend_tokens=7, policy="mixed")
    tokens, ev = _generate(llm, prompts[:12], outputs[:12])
    assert ev.requests("retracted")
    assert tokens == runs["hf"][:12]


@pytest.mark.parametrize("budget, policy", RUNS[:2])
def test_events_of_a_retraction(runs, budget: int, policy: str) -> None:
    """A `retracted` event names the tokens to recompute; then its `recompute` items cover them
    (the last one samples), then its remaining tokens come; the readmission says `recompute`."""
    prompts = runs["prompts"]
    ev = runs[budget, policy][1]
    for r in ev.requests("retracted"):
        prompt = prompts[r.uid % N_REQ]  # uids go on across the runs of one engine
        assert r.fields["recompute_len"] == len(prompt) + r.fields["output_len"]
        after = ev.all[ev.all.index(r) + 1 :]
        readmit = next(e for e in after if isinstance(e, RequestEvent) and e.uid == r.uid)
        assert readmit.event == "admitted" and readmit.fields["recompute"] is True
        pieces = []
        for step in (e for e in after if isinstance(e, StepRecord)):
            mine = [i for i in step.items if i.uid == r.uid]
            if pieces and not mine:
                break
            pieces += mine
            if mine and mine[0].kind != "recompute":
                break
        assert pieces[-1].kind == "decode" or pieces[-1].sample
        pieces = [p for p in pieces if p.kind == "recompute"]
        assert pieces[0].start == readmit.fields["cached_len"]
        assert pieces[-1].end == r.fields["recompute_len"] and pieces[-1].sample
        assert all(a.end == b.start for a, b in zip(pieces, pieces[1:], strict=False))
        assert not any(p.sample for p in pieces[:-1])
        # its next token comes from the step that ends its recompute, none before
        done = next(e for e in after if isinstance(e, StepRecord) and pieces[-1] in e.items)
        first = next(e for e in after if isinstance(e, TokenEvent) and e.uid == r.uid)
        assert after.index(first) > after.index(done)
        assert first.t == done.t1
    reasons = {s.queue.waiting_reason for s in ev.steps}
    assert {"kv", "budget"} <= reasons


def test_admission_setting_is_checked(tiny_llama_dir) -> None:
    with pytest.raises(InvalidRequest, match="unknown admission"):
        LLM(str(tiny_llama_dir), admission="eager", progress=False)
    llm = LLM(str(tiny_llama_dir), num_pages=64, max_seq_len=64, progress=False)
    with pytest.raises(InvalidRequest, match="unknown admission"):
        llm.set_config(admission="lazy", policy="mixed")
    assert llm.config_dict() == {
        "max_extend_tokens": 256, "policy": "prefill_first", "admission": "reserve"
    }  # fmt: skip
    assert llm.set_config(admission="optimistic")["admission"] == "optimistic"
    with pytest.raises(InvalidRequest, match="schedule_conservativeness"):
        LLM(str(tiny_llama_dir), schedule_conservativeness=0, progress=False)


# -- the bookkeeping, without a model -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_with_admission_switches_leaks_nothing(seed: int) -> None:
    """Random pool sizes, page sizes, budgets, policies and EOS rates, admission switched
    mid-run: after every step the pool adds up and every counter equals a full recount; at the
    end every page is free or cached."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 1, 4])
    max_seq_len = 48
    num_pages = rng.randrange(max_seq_len // page_size + 1, 2 * max_seq_len // page_size)
    sim = SchedulerSim(
        num_pages,
        page_size,
        rng.randrange(4, 13),
        max_seq_len,
        rng.choice(["radix", "naive"]),
        seed,
    )
    sim.scheduler.ratio = NewTokenRatio.scaled(rng.choice([0.3, 1.0]), rng.choice([3, 20, 600]))
    shared = [rng.randrange(3, 999) for _ in range(12)]
    kv, sched = sim.kv, sim.scheduler
    admission, retracted, reasons = "optimistic", 0, set()
    for step in range(400):
        for _ in range(rng.choice([0, 0, 1, 3]) if step < 300 else 0):
            prompt = (shared[: rng.randrange(0, 12)] if rng.random() < 0.5 else []) + [
                rng.randrange(3, 999) for _ in range(rng.randrange(1, 16))
            ]
            sim.submit(prompt, rng.randrange(1, max_seq_len - len(prompt) + 1))
        if rng.random() < 0.05:
            admission = "reserve" if admission == "optimistic" else "optimistic"
        before = sched.num_retractions
        sim.step(rng.choice(["prefill_first", "mixed"]), rng.choice([1, 3, 7, 64]), 0.03, admission)
        retracted += sched.num_retractions - before
        st = kv.stats(sched.reserved_tokens())
        assert st.used + st.cached + st.free == st.total == num_pages
        sched.check_counters()
        kv.check_integrity(sched.active_rows())
        reasons.add(sim.last_reason)
    while sched.has_work():
        sim.step("mixed", 16, 0.0, "optimistic")
    st = kv.stats(sched.reserved_tokens())
    assert st.used == 0 and st.reserved == 0 and st.free + st.cached == num_pages
    kv.check_integrity([])
    assert retracted > 0 and "kv" in reasons, (retracted, reasons)


def _reason(sim: SchedulerSim, **kw: object) -> str | None:
    sim.step(**kw)  # type: ignore[arg-type]
    return sim.last_reason


def test_each_waiting_reason() -> None:
    """budget: the step's tokens are spent; max_running: no row; reserved: the pages are there
    but promised; kv: they are not there at all (held by running requests)."""
    sim = SchedulerSim(num_pages=40, max_running_req=8)
    for _ in range(3):
        sim.submit([5] * 10, 4)
    assert _reason(sim, budget=12) == "budget"  # 10 + 2 tokens: the second is chunked
    sim = SchedulerSim(num_pages=40, max_running_req=1)
    sim.submit([5] * 4, 4), sim.submit([6] * 4, 4)
    assert _reason(sim) == "max_running"
    sim = SchedulerSim(num_pages=40)
    sim.submit([5] * 4, 30), sim.submit([6] * 4, 30)  # 34 pages promised, 6 left
    assert _reason(sim) == "reserved"
    sim = SchedulerSim(num_pages=40)
    sim.submit([5] * 30, 4)
    sim.step(budget=64, admission="optimistic")  # 30 pages used
    sim.submit([6] * 12, 4)
    assert _reason(sim, budget=64, admission="optimistic") == "kv"
    assert sim.scheduler.num_waiting == 1
    assert _reason(sim, admission="optimistic") == "kv"  # decoding, not enough pages yet


def test_the_fold_counts_retractions_and_recomputed_tokens(runs) -> None:
    """The shared fold's summary (the bench's table, the sweep, the page) over a run's messages
    equals the engine's own counts; recomputed tokens are not prompt tokens."""
    from instrumentation.fold import Fold, summarize_steps

    ev = runs[7, "mixed"][1]
    fold = Fold(max_steps=None)
    for e in ev.all:
        fold.apply(e.to_dict())
    s = fold.summary()
    steps = [e.to_dict() for e in ev.steps]
    assert s.retractions == len(ev.requests("retracted")) >= 10
    assert s.recomputed_tokens == sum(i.num_tokens for e in ev.steps for i in e.items
                                      if i.kind == "recompute") > 0  # fmt: skip
    computed = sum(i.num_tokens for e in ev.steps for i in e.items if i.kind != "decode")
    assert s.prompt_tokens + s.recomputed_tokens == computed
    assert s.output_tokens == sum(len(t) for t in runs[7, "mixed"][0])
    window = summarize_steps(steps, [r.to_dict() for r in fold.requests()])
    assert (window.retractions, window.recomputed_tokens) == (s.retractions, s.recomputed_tokens)
    assert all(r.retractions >= 0 for r in fold.requests())
    assert sum(r.retractions for r in fold.requests()) == s.retractions
