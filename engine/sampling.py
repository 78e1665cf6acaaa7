"""Sampling parameters (validated, never clamped) and the sampler that turns logits into tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequest

if TYPE_CHECKING:
    import torch


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (isinstance(v, int | float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise InvalidRequest(f"top_k must be -1 or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of `logits`, as an int64 tensor on the logits' device. Nothing here
    waits for the device, so on CUDA the host can go on while the tokens are computed."""
    import torch

    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # float64 and the max subtracted first: a tiny temperature (1e-300 is valid) must not
        # overflow into inf - inf = NaN; it tends to greedy, as it should
        row = logits[i].double()
        row = (row - row.max()) / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_p.cumsum(0) - sorted_p > p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out
