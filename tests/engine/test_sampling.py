"""The sampler: unseeded rows are sampled together, and each row still gets its own params."""

from __future__ import annotations

import math

import pytest

from instrumentation.sampling import SamplingParams

torch = pytest.importorskip("torch")

from engine.sampling import sample_tokens  # noqa: E402

# one row of logits: token 3 is the likeliest, then 2, 1, 0; tokens 4..7 are rare
ROW = [0.0, 1.0, 2.0, 3.0, -4.0, -4.0, -4.0, -4.0]


def draw(params: list[SamplingParams], repeats: int) -> list[list[int]]:
    """`repeats` batched calls' tokens, per row (the default generator, seeded here)."""
    torch.manual_seed(0)
    logits = torch.tensor([ROW] * len(params))
    cols: list[list[int]] = [[] for _ in params]
    for _ in range(repeats):
        for i, t in enumerate(sample_tokens(logits, params, [None] * len(params)).tolist()):
            cols[i].append(t)
    return cols


def test_each_row_of_a_batch_keeps_its_own_filters() -> None:
    params = [
        SamplingParams(temperature=0),  # greedy
        SamplingParams(temperature=1.0, top_k=2),  # tokens 3 and 2 only
        SamplingParams(temperature=1.0, top_p=0.6),  # 3 has 0.64 of the mass: 3 alone
        SamplingParams(temperature=1.0, min_p=0.3),  # above 0.3 x p(3): 3 and 2
        SamplingParams(temperature=1.0),  # anything, 4..7 rarely
        SamplingParams(temperature=1e-300),  # tends to greedy, never NaN
    ]
    cols = draw(params, 400)
    assert set(cols[0]) == {3}
    assert set(cols[1]) == {2, 3}
    assert set(cols[2]) == {3}
    assert set(cols[3]) == {2, 3}
    assert {0, 1, 2, 3} <= set(cols[4])
    assert set(cols[5]) == {3}


def test_a_batched_row_draws_from_the_softmax() -> None:
    n = 4000
    (col,) = draw([SamplingParams(temperature=2.0)], n)
    weights = [math.exp(x / 2.0) for x in ROW]
    for token in range(4):  # 5 standard deviations of each frequency, at most 0.04
        p = weights[token] / sum(weights)
        assert abs(col.count(token) / n - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_a_seeded_row_is_its_seed_s_beside_any_batch() -> None:
    logits = torch.tensor([ROW] * 3)
    seeded = SamplingParams(temperature=1.5, top_k=4, seed=7)

    def run(others: SamplingParams) -> list[int]:
        g = torch.Generator().manual_seed(7)
        return [sample_tokens(logits, [others, seeded, others], [None, g, None])[1].item()
                for _ in range(50)]  # fmt: skip

    assert run(SamplingParams(temperature=1.0)) == run(SamplingParams(temperature=0))
