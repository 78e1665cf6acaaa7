"""Test helpers: Hugging Face greedy references and step-record collection."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from instrumentation.records import EngineEvent, RequestEvent, StepRecord, TokenEvent

LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 3
CHAPTER_PROMPTS = [LONG, "1 + 1 =", "The capital of France is"]


@functools.lru_cache(maxsize=4)
def _hf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
def _hf_greedy_one(path: str, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    model = _hf_model(path)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return tuple(out[0, len(ids) :].tolist())


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Hugging Face `generate(do_sample=False)` on the same weights, whole prompt at once."""
    return [list(_hf_greedy_one(str(path), tuple(p), n)) for p in prompts]


class Events:
    """Collects everything an LLM emits, in order."""

    def __init__(self) -> None:
        self.all: list[EngineEvent] = []

    def __call__(self, ev: EngineEvent) -> None:
        self.all.append(ev)

    @property
    def steps(self) -> list[StepRecord]:
        return [e for e in self.all if isinstance(e, StepRecord)]

    @property
    def tokens(self) -> list[TokenEvent]:
        return [e for e in self.all if isinstance(e, TokenEvent)]

    def requests(self, event: str | None = None) -> list[RequestEvent]:
        return [e for e in self.all if isinstance(e, RequestEvent) and event in (None, e.event)]

    def clear(self) -> None:
        self.all.clear()


class SchedulerSim:
    """The scheduler, the KV manager and a prefix cache driven like the engine drives them, with
    no model: each step's sampled token is drawn at random. For properties of the bookkeeping
    (and `python -m bench.schedule`), at thousands of steps a second."""

    def __init__(
        self,
        num_pages: int,
        page_size: int = 1,
        max_running_req: int = 8,
        max_seq_len: int = 256,
        cache_type: str = "radix",
        seed: int = 0,
    ) -> None:
        import random

        from engine.kvcache.manager import KVManager
        from engine.kvcache.naive import NaiveCache
        from engine.kvcache.radix import RadixCache
        from engine.kvcache.table import PageTable
        from engine.scheduler.policy import POLICIES
        from engine.scheduler.scheduler import Scheduler

        table = PageTable(max_running_req, max_seq_len, page_size)
        cache = RadixCache(page_size) if cache_type == "radix" else NaiveCache(page_size)
        self.kv = KVManager(num_pages, page_size, table, cache)
        self.scheduler = Scheduler(self.kv)
        self.policies = {name: cls() for name, cls in POLICIES.items()}
        self.rng = random.Random(seed)
        self.uids = 0
        self.t = 0.0
        self.last_reason: str | None = None  # the last step's waiting reason

    def submit(self, prompt: list[int], max_tokens: int) -> int:
        from engine.request import RequestState
        from instrumentation.sampling import SamplingParams

        uid, self.uids = self.uids, self.uids + 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add(RequestState(uid, prompt, params, self.t, detok=None))  # type: ignore[arg-type]
        return uid

    def step(
        self,
        policy: str = "prefill_first",
        budget: int = 16,
        eos_rate: float = 0.0,
        admission: str = "reserve",
    ) -> bool:
        """One engine step: schedule, advance, "sample" a token for every request that samples,
        retire the ones that end (by length, or by an EOS drawn with `eos_rate`)."""
        self.t += 1.0
        s = self.scheduler.schedule(self.policies[policy], budget, self.t, admission)
        self.last_reason = None if s is None else s.waiting_reason
        if s is None:
            return False
        self.scheduler.advance(s.batch)
        finishing = {r.uid for r in self.scheduler.finishing}
        for req in s.batch.reqs:
            if not req.can_decode:
                continue
            req.append_token(self.rng.randrange(3, 1000), self.t, int(self.t))
            if req.uid in finishing:
                self.scheduler.retire(req)
            elif self.rng.random() < eos_rate:
                req.state.finish_reason = "eos"
                self.scheduler.retire(req)
        return True
