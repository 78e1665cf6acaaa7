"""The protocol's vocabulary, declared once (docs/protocol.md): every module that names a
request state, a broadcast type, an item kind, a policy or a cache type imports it from here."""

from __future__ import annotations

from typing import Literal

__all__ = [
    "ADMISSION_MODES",
    "BROADCAST_TYPES",
    "CACHE_TYPES",
    "ENDED_STATES",
    "POLICY_NAMES",
    "RequestState",
    "SAMPLING_KINDS",
    "WAIT_REASONS",
    "WaitReason",
]

RequestState = Literal["waiting", "running", "finished", "aborted", "rejected"]
# why the head of the waiting queue was not admitted in a step (v1.3)
WaitReason = Literal["budget", "kv", "max_running", "reserved"]
WAIT_REASONS: tuple[str, ...] = ("budget", "kv", "max_running", "reserved")
# how admission weighs a request's future outputs (`set_config`'s `admission`, v1.3)
ADMISSION_MODES: tuple[str, ...] = ("reserve", "optimistic")
# a request in one of these states has ended: no step lists it again
ENDED_STATES: frozenset[str] = frozenset(("finished", "aborted", "rejected"))
# the messages every client receives, numbered by `seq` (v1.1); replies to a sender are not
BROADCAST_TYPES: frozenset[str] = frozenset(("step", "token", "request", "config"))
# step items that sample a token (a `chunk` leaves the prompt unfinished and samples nothing; a
# `recompute` piece samples only when marked `sample`: see instrumentation.fold.samples)
SAMPLING_KINDS: frozenset[str] = frozenset(("prefill", "decode"))
# `set_config`'s policies, in the order controls offer them
POLICY_NAMES: tuple[str, ...] = ("prefill_first", "mixed")
# the prefix caches `--cache-type` chooses from
CACHE_TYPES: tuple[str, ...] = ("radix", "naive")
