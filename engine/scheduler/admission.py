"""Admission modes: how much of a request's future the pool must promise before it runs.

- `reserve` (the chapter's rule): the pages of the whole prompt and all of `max_tokens`. Nothing
  admitted ever waits for room, and nothing is ever retracted; the pool is often idle, promised
  to outputs that end early at EOS.
- `optimistic` (SGLang's scheme): only the prompt's pages are promised. A request is admitted
  while its prompt plus its outputs times `new_token_ratio`, plus the same estimate for every
  admitted optimistic request, fits the free and evictable pages. The ratio starts at `init`,
  decays by `decay` per step down to `floor` (outputs usually end early, so the pool is trusted
  more and more), and after a retraction jumps back up to what the running requests show.
  When a decode step cannot get its pages, running requests are retracted (the most recently
  admitted first) until it can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# SGLang's defaults: init_new_token_ratio 0.7, min_new_token_ratio 0.7 * 0.14, decayed over 600
# steps; after a retraction each running request is assumed to need this many more tokens
INIT_RATIO = 0.7
MIN_RATIO = INIT_RATIO * 0.14
DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


@dataclass(slots=True)
class NewTokenRatio:
    """The fraction of an optimistic request's remaining `max_tokens` that admission counts."""

    init: float = INIT_RATIO
    floor: float = MIN_RATIO
    decay_steps: int = DECAY_STEPS
    value: float = INIT_RATIO

    @classmethod
    def scaled(cls, conservativeness: float = 1.0, decay_steps: int = DECAY_STEPS) -> NewTokenRatio:
        """SGLang's `--schedule-conservativeness`: the start and the floor scale with it."""
        init = min(1.0, INIT_RATIO * conservativeness)
        return cls(
            init=init, floor=init * MIN_RATIO / INIT_RATIO, decay_steps=decay_steps, value=init
        )

    def decay(self) -> None:
        """One step without a retraction."""
        step = (self.init - self.floor) / self.decay_steps
        self.value = max(self.floor, self.value - step)

    def after_retraction(self, decoded: int, max_tokens: int, running: int) -> None:
        """Reset upward to what the survivors show: the tokens they have generated plus a few
        steps more each, over their `max_tokens` (SGLang's estimate), and never downward."""
        if max_tokens <= 0:
            self.value = max(self.value, self.init)
            return
        estimate = (decoded + RETRACT_DECODE_STEPS * running) / max_tokens
        self.value = min(1.0, max(self.value, estimate, self.init))

    def tokens(self, outputs: int) -> int:
        """The estimate for `outputs` remaining outputs, rounded up."""
        return math.ceil(outputs * self.value - 1e-9) if outputs > 0 else 0
