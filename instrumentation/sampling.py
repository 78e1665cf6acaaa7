"""Sampling parameters: validated, never clamped. Torch-free: the protocol's `submit` carries them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from instrumentation.errors import InvalidRequest

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default --max-logprobs


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
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    # the sampled token's log-probability plus this many top alternatives (None: none);
    # raw: the model's distribution before temperature and filters, as vLLM's default
    logprobs: int | None = None
    # the same for every prompt token but the first (None: none); the prompt is then computed
    # whole, not served from the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

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
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequest(
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
