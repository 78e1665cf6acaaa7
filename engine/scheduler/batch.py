"""Batch: the requests of one step, what kind of work each does, and the step's phase."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import ChunkedReq, Req
from instrumentation.records import ItemKind, Phase


@dataclass(frozen=True, slots=True)
class Batch:
    reqs: list[Req]  # tokens [req.cached_len, req.device_len) of each are computed this step
    decode: frozenset[int]  # uids that decode one token this step

    def kind(self, req: Req) -> ItemKind:
        if req.uid in self.decode:
            return "decode"
        if req.state.retractions:  # prompt work of a retracted request: prompt plus outputs
            return "recompute"
        return "chunk" if isinstance(req, ChunkedReq) else "prefill"

    def samples(self, req: Req) -> bool:
        """Whether the step samples a token for `req`: all but the pieces that leave some of
        the input (prompt, or prompt plus outputs for a recompute) still to compute."""
        return not isinstance(req, ChunkedReq)

    @property
    def phase(self) -> Phase:
        n_dec = len(self.decode)
        if n_dec == len(self.reqs):
            return "decode"
        return "mixed" if n_dec else "prefill"

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.reqs)
