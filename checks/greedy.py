"""Greedy runs traced step by step with the logits behind each token, and their comparison: the
same tokens, a divergence at a near-tie (bf16 noise), or a mismatch where the reference had a
clear winner (a bug)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# A greedy divergence is a near-tie when the reference's top-2 gap is within this many RMS of
# the two runs' logit difference at that step (their inputs being identical up to there).
TIE_NOISE = 4.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


class LogitTap:
    """Records the logits each launched step hands to the sampler, one [rows, vocab] tensor per
    launch, in launch order. Step records come in the same order, with or without overlap, so
    `rows_of(record)` finds the tensor behind a record."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self._read = 0

    def __enter__(self) -> LogitTap:
        import engine.runner as runner

        self._runner, self._sample = runner, runner.sample_tokens

        def tapped(logits: torch.Tensor, *args: Any) -> torch.Tensor:
            self.calls.append(logits.float().cpu())
            return self._sample(logits, *args)

        runner.sample_tokens = tapped
        return self

    def __exit__(self, *exc: object) -> None:
        self._runner.sample_tokens = self._sample

    def rows_of(self, record: Any) -> torch.Tensor | None:
        """The logits behind a step record (None for a record of chunks only, or no record)."""
        if record is None or all(it.kind == "chunk" for it in record.items):
            return None
        self._read += 1
        return self.calls[self._read - 1]


@dataclass
class Trace:
    """One request's greedy run: each sampled token and the logits row it came from."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def trace_run(llm: Any, prompts: list[list[int]], params: Any) -> list[Trace]:
    """Run prompts to completion step by step, mapping each logits row to its request through
    the step record (sampled rows are the non-chunk items, in batch order)."""
    uids = [llm.submit(p, params) for p in prompts]
    traces = {u: Trace() for u in uids}
    with LogitTap() as tap:
        while llm.has_work():
            record = llm.step()
            logits = tap.rows_of(record)
            if logits is None:
                continue
            rows = [it.uid for it in record.items if it.kind != "chunk"]
            for uid, row in zip(rows, logits, strict=True):
                traces[uid].tokens.append(int(row.argmax()))
                traces[uid].logits.append(row)
    return [traces[u] for u in uids]


def compare_greedy(ref: list[Trace], other: list[Trace], n_tokens: int) -> dict[str, Any]:
    """Per request over its first n_tokens: `same`; diverged at a near-tie (`ties`: the two
    runs' logits differ by bf16 noise and the reference's top-2 gap is within that noise); or
    diverged where the reference had a clear winner (`mismatches`: a bug). `worst_rel_err` is
    the largest relative logits difference at steps whose inputs were still identical."""
    out: dict[str, Any] = {"same": 0, "ties": 0, "mismatches": 0, "worst_rel_err": 0.0}
    for a, b in zip(ref, other, strict=True):
        ta, tb = a.tokens[:n_tokens], b.tokens[:n_tokens]
        j = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
        last = len(ta) - 1 if j is None else j  # inputs are identical up to and with step j
        for i in range(last + 1):
            out["worst_rel_err"] = max(out["worst_rel_err"], rel_err(b.logits[i], a.logits[i]))
        if j is None:
            out["same"] += 1
            continue
        gap, noise = tie_margin(a.logits[j], b.logits[j], ta[j], tb[j])
        out["ties" if gap <= TIE_NOISE * noise else "mismatches"] += 1
    return out


def tie_margin(ref: torch.Tensor, other: torch.Tensor, want: int, got: int) -> tuple[float, float]:
    """At a greedy divergence with identical inputs: the reference's logit gap between its token
    and the other run's, and the RMS of the two runs' logit difference there. A near-tie when
    the gap is within TIE_NOISE of that noise."""
    return float(ref[want] - ref[got]), float((ref - other).pow(2).mean().sqrt())


def last_logits(llm: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits each prompt's first token is sampled from."""
    import engine.runner as runner
    from instrumentation.sampling import SamplingParams

    rows: list[torch.Tensor] = []
    sample = runner.sample_tokens

    def tapped(logits: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(logits[0].float().clone())
        return sample(logits, *args)  # type: ignore[arg-type]

    runner.sample_tokens = tapped
    try:
        for p in prompts:
            llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        runner.sample_tokens = sample
    return rows
