"""Overlap scheduling (step N+1 scheduled and launched before step N's tokens are read), run on
CPU where each step's tokens are simply read one call later: the same tokens as Hugging Face and
as the synchronous engine, EOS read one step late, aborts of requests in flight, event order."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from instrumentation.records import RequestEvent, StepRecord, TokenEvent
from tests.engine.test_engine_exact import N_OUT, _check, _random_prompts
from tests.helpers import Events, hf_greedy


def _overlap_llm(path: object, **kw: object) -> LLM:
    llm = LLM(str(path), overlap=True, progress=False, **kw)  # type: ignore[arg-type]
    assert llm.overlap and llm.info.overlap
    return llm


@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_matches_hf(tiny_llama_dir, page_size: int) -> None:
    prompts = _random_prompts(3)
    ref = hf_greedy(tiny_llama_dir, prompts, N_OUT)
    llm = _overlap_llm(tiny_llama_dir, page_size=page_size, max_running_req=4)
    _check(llm, prompts, ref, [1, 6, 16, 8192], "prefill_first")
    _check(llm, prompts, ref, [2, 7, 64], "mixed")


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Events:
    ev = Events()
    llm.add_event_hook(ev)
    uids = [llm.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while llm.has_work():
        llm.step()
    assert not llm.in_flight
    llm.check_integrity()
    assert llm.kv_stats().used == 0 and llm.kv_stats().reserved == 0
    ev.uids = uids  # type: ignore[attr-defined]
    return ev


def _outputs(ev: Events) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for t in ev.tokens:
        out.setdefault(t.uid, []).append(t.token_id)
    return out


def _check_order(ev: Events) -> None:
    """Per request: queued, admitted, first_token, then finished or aborted; no token before
    it was queued or after it ended, and no step listing it after it ended unless its item is
    marked wasted (a step launched before its EOS was read)."""
    seen: dict[int, list[str]] = {}
    ended: set[int] = set()
    for e in ev.all:
        if isinstance(e, RequestEvent):
            seen.setdefault(e.uid, []).append(e.event)
            if e.event in ("finished", "aborted"):
                ended.add(e.uid)
        elif isinstance(e, TokenEvent):
            assert e.uid not in ended, f"token for {e.uid} after it ended"
            assert e.uid in seen  # queued first (admitted follows its step's tokens)
        elif isinstance(e, StepRecord):
            assert not {it.uid for it in e.live_items} & ended, "a step lists an ended request"
    for kinds in seen.values():
        assert kinds[0] == "queued", kinds
        if "first_token" in kinds:
            assert kinds.index("admitted") < kinds.index("first_token"), kinds
        assert kinds[-1] in ("finished", "aborted"), kinds
    steps = [s.step for s in ev.steps]
    assert steps == list(range(steps[0], steps[0] + len(steps)))


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
def test_sampled_tokens_and_eos_match_the_synchronous_engine(tiny_llama_dir, policy) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (30, 7, 19, 44)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=1),
        SamplingParams(max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.3, top_p=0.9, seed=2),
        SamplingParams(max_tokens=1),
    ]
    kw = {"max_extend_tokens": 16, "policy": policy, "max_running_req": 4}
    sync = _run(LLM(str(tiny_llama_dir), progress=False, **kw), prompts, params)
    ref = _outputs(sync)
    # make a token the first request samples mid-way an EOS: the synchronous engine stops
    # there, the overlapped one reads it a step late, after it launched one more step for it
    eos = ref[sync.uids[0]][4]  # type: ignore[attr-defined]
    a = LLM(str(tiny_llama_dir), progress=False, **kw)
    b = _overlap_llm(tiny_llama_dir, **kw)
    for llm in (a, b):
        llm.eos_token_ids = frozenset({eos})
    sync, lap = _run(a, prompts, params), _run(b, prompts, params)
    assert _outputs(lap) == _outputs(sync)
    first = _outputs(sync)[sync.uids[0]]  # type: ignore[attr-defined]
    assert first[-1] == eos and len(first) <= 5

    def ends(ev: Events) -> dict[int, tuple]:
        return {
            e.uid: (e.fields["finish_reason"], e.fields["output_len"], e.fields["text"])
            for e in ev.requests("finished")
        }

    assert ends(lap) == ends(sync) and ends(sync)[sync.uids[0]][0] == "eos"  # type: ignore[attr-defined]
    _check_order(lap)
    _check_order(sync)

    # the same work, in the same steps: overlap changes when tokens are read, not the schedule
    # (but for the work launched for a request whose EOS was not read yet: marked wasted)
    def live(ev: Events) -> list[tuple]:
        return [s.live_items for s in ev.steps if s.live_items]

    assert live(lap) == live(sync)
    wasted = [it for s in lap.steps for it in s.items if it.wasted]
    assert wasted and {it.uid for it in wasted} == {sync.uids[0]}  # type: ignore[attr-defined]
    assert not any(it.wasted for s in sync.steps for it in s.items)
    # generate() leaves no step behind, not even one launched for a request already ended
    out = b.generate(prompts[:1], params[:1])
    assert out[0]["finish_reason"] == "eos" and not b.has_work()


def _in_flight(llm: LLM) -> set[int]:
    assert llm.pipeline.inflight is not None
    return {r.uid for r in llm.pipeline.inflight.batch.reqs}


def test_abort_while_its_step_is_in_flight(tiny_llama_dir) -> None:
    llm = _overlap_llm(tiny_llama_dir, max_extend_tokens=8, cache_type="naive", policy="mixed")
    rng = random.Random(7)
    ev = Events()
    llm.add_event_hook(ev)
    dec = llm.submit([rng.randrange(3, 49152) for _ in range(5)], SamplingParams(max_tokens=40))
    last = llm.submit([rng.randrange(3, 49152) for _ in range(6)], SamplingParams(max_tokens=4))
    other = llm.submit([rng.randrange(3, 49152) for _ in range(6)], SamplingParams(max_tokens=6))
    while len([t for t in ev.tokens if t.uid == last]) < 3:
        llm.step()
    # `last` is sampling its final token: it is no longer scheduled and its pages are back,
    # but it has not ended
    assert last in _in_flight(llm) and last in llm.pipeline.finishing
    llm.abort(last)
    llm.step()
    chunked = llm.submit([rng.randrange(3, 49152) for _ in range(40)], SamplingParams(max_tokens=5))
    llm.step()
    llm.step()
    assert {dec, chunked} <= _in_flight(llm)  # a decode and a chunk, both running
    llm.abort(dec)
    llm.abort(chunked)
    while llm.has_work():
        llm.step()
    _check_order(ev)
    assert [e.uid for e in ev.requests("aborted")] == [last, dec, chunked]
    assert [e.uid for e in ev.requests("finished")] == [other]
    assert len([t for t in ev.tokens if t.uid == last]) == 3
    llm.check_integrity()
    end = llm.kv_stats()
    assert end.used == 0 and end.reserved == 0 and end.free == end.total


def test_wait_hooks_run_before_waiting_for_a_step(tiny_llama_dir, monkeypatch) -> None:
    """On CUDA a step's tokens are often not ready when the engine asks for them; the wait
    hooks (the server hands its events over there) run then, and only then."""
    from engine.runner import Launched

    llm = _overlap_llm(tiny_llama_dir)
    ev = Events()
    llm.add_event_hook(ev)
    calls: list[int] = []
    llm.add_wait_hook(lambda: calls.append(len(ev.steps)))
    prompt = [5, 6, 7, 8]
    llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    assert calls == []  # on CPU every step is done by the time its tokens are read
    monkeypatch.setattr(Launched, "done", lambda self: False)
    llm.add_wait_hook(lambda: 1 / 0)  # a failing hook is logged, never the engine's failure
    before = len(ev.steps)
    out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 3
    # once per completed step, each before that step's record was emitted
    assert calls == [before, before + 1, before + 2]
