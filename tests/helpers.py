"""Test helpers: Hugging Face greedy references and step-record collection."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from engine.records import EngineEvent, RequestEvent, StepRecord, TokenEvent

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
