"""Step records are the truth: the same whether or not steps overlap, and every step that ran is
recorded, with the work of requests that ended while it ran marked wasted."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine import LLM, SamplingParams
from instrumentation.records import StepRecord
from tests.helpers import Events


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    # a shared prefix for the radix cache to hit, long prompts that take several chunks,
    # short ones that finish within the long ones' chunking
    prefix = [rng.randrange(3, 49152) for _ in range(24)]
    lengths = (70, 5, 33, 12, 90, 3, 41, 8)
    prompts = [
        (prefix if i % 3 == 0 else []) + [rng.randrange(3, 49152) for _ in range(n)]
        for i, n in enumerate(lengths)
    ]
    # ignore_eos: an EOS is read one step late under overlap, which launches one more (wasted)
    # step for that request; this test is about everything else being the same
    params = [SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True) for _ in prompts]
    return prompts, params


def _records(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    ev = Events()
    llm.add_event_hook(ev)
    # requests arrive while others run: some are queued mid-burst
    for p, sp in zip(prompts[:5], params[:5], strict=True):
        llm.submit(p, sp)
    n = 0
    while llm.has_work() or n < 6:
        if n == 5:
            for p, sp in zip(prompts[5:], params[5:], strict=True):
                llm.submit(p, sp)
        llm.step()
        n += 1
    llm.check_integrity()
    out = []
    for rec in ev.steps:
        d: dict[str, Any] = rec.to_dict()
        d.pop("t0"), d.pop("t1")
        out.append(d)
    return out


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
def test_records_are_the_same_with_and_without_overlap(tiny_llama_dir, policy: str) -> None:
    prompts, params = _workload(11)
    # a pool small enough that admission waits for pages, with the radix cache holding some
    kw: dict[str, Any] = dict(
        max_extend_tokens=16, policy=policy, max_running_req=6, num_pages=260, progress=False
    )
    sync = _records(LLM(str(tiny_llama_dir), overlap=False, **kw), prompts, params)
    lap = _records(LLM(str(tiny_llama_dir), overlap=True, **kw), prompts, params)
    assert len(sync) == len(lap)
    for a, b in zip(sync, lap, strict=True):
        assert a == b, f"step {a['step']}: {a} != {b}"
    # the workload exercised what the records describe: chunks, waiting, cache hits
    kinds = {it["kind"] for s in sync for it in s["items"]}
    assert kinds == {"chunk", "prefill", "decode"}
    assert max(s["queue"]["waiting"] for s in sync) >= 1
    assert max(s["kv"]["cached"] for s in sync) >= 1
    assert all(s["kv"]["used"] >= 1 for s in sync)  # a step's own batch holds pages


def test_a_step_whose_requests_all_ended_while_it_ran_is_recorded(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), overlap=True, max_extend_tokens=8, policy="mixed",
              progress=False)  # fmt: skip
    ev = Events()
    llm.add_event_hook(ev)
    rng = random.Random(3)
    uids = [
        llm.submit([rng.randrange(3, 49152) for _ in range(n)], SamplingParams(max_tokens=30))
        for n in (4, 5, 30)  # two decoding, one still being chunked
    ]
    while len(ev.tokens) < 4:
        llm.step()
    assert llm.pipeline.inflight is not None
    running = {r.uid for r in llm.pipeline.inflight.batch.reqs}
    assert running == set(uids)
    number = llm.pipeline.step_no  # the record the in-flight step will get
    for uid in uids:
        llm.abort(uid)
    while llm.has_work():
        llm.step()
    (rec,) = [s for s in ev.steps if s.step == number]
    assert isinstance(rec, StepRecord)
    assert {it.uid for it in rec.items} == set(uids)
    assert all(it.wasted for it in rec.items)
    assert {it.kind for it in rec.items} == {"decode", "chunk"}
    assert rec.to_dict()["items"][0]["wasted"] is True
    # the step's record precedes the aborts, and no later step lists them
    order = [(type(e).__name__, getattr(e, "event", None)) for e in ev.all]
    assert order.index(("StepRecord", None)) < order.index(("RequestEvent", "aborted"))
    assert not [s for s in ev.steps if s.step > number]
    assert not any(t.uid in uids and t.t >= rec.t1 for t in ev.tokens)
    llm.check_integrity()
    kv = llm.kv_stats()
    assert kv.used == 0 and kv.reserved == 0 and kv.free + kv.cached == kv.total
    assert not llm.has_work() and llm.queue_stats().running == 0
