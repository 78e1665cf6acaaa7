"""The float32 residual stream (`residual_dtype="float32"`): in bfloat16 it brings the logits
closer to the same weights computed in float32 than the usual bfloat16 stream (Hugging Face's
layout).

What the option changes is where the stream is rounded, so that is what the test isolates. A CPU's
own bfloat16 matmul kernels differ (AVX2 widens to float32; AVX512-BF16 and AMX units round
differently), and on one machine their error alone took the float32-stream logits past a bound
that another machine met 3x over. Here every bfloat16 matmul is computed as a float32 matmul of
the same bfloat16 values, rounded back to bfloat16 (what a float32-accumulating kernel gives).
The elementwise bfloat16 kernels still differ by vector unit (measured below under each).
"""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from checks.greedy import last_logits, rel_err
from engine import LLM
from tests.models import cached_tiny


@pytest.fixture
def float32_accumulating_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models.kernels import onednn_linear, onednn_weight

    linear = torch.nn.functional.linear
    # each weight's float32 copy, made once (converting all 135M parameters on every forward was
    # most of this test's time), and reordered for oneDNN as the float32 engine's own weights
    # are: F.linear's BLAS on the plain copies took 2.4x as long for the same products
    wide_weights: dict[tuple[int, torch.Size], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def widen(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = (w.data_ptr(), w.shape)
        if key not in wide_weights:
            wide = w.float()
            wide_weights[key] = (wide, onednn_weight(wide) if wide.dim() == 2 else None)
        return wide_weights[key]

    def widened(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return linear(x, w, b)
        wide, packed = widen(w)
        bias = None if b is None else widen(b)[0]
        x32 = x.float()
        out = None if packed is None else onednn_linear(x32, packed, bias)
        return (linear(x32, wide, bias) if out is None else out).to(x.dtype)

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def widened_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a, **kw) -> torch.Tensor:
        if q.dtype != torch.bfloat16:
            return sdpa(q, k, v, *a, **kw)
        return sdpa(q.float(), k.float(), v.float(), *a, **kw).to(q.dtype)

    monkeypatch.setattr(torch.nn.functional, "linear", widened)  # what nn.Linear calls
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", widened_sdpa)


# a deep, narrow random Llama: as many residual adds as SmolLM2 (30 layers, 60 adds), at a
# fraction of its FLOPs (this test on SmolLM2 took a minute of CPU)
DEEP = dict(num_hidden_layers=30, hidden_size=256, intermediate_size=512, proj_std=0.05)


@pytest.fixture(scope="module")
def deep_llama_dir(smollm2_dir) -> object:
    return cached_tiny("llama", smollm2_dir, **DEEP)


@pytest.mark.usefixtures("float32_accumulating_matmuls")
def test_float32_residual_stream_cuts_the_bf16_error(deep_llama_dir) -> None:
    kw = dict(model=str(deep_llama_dir), max_seq_len=512, num_pages=2048, max_running_req=2,
              progress=False)  # fmt: skip
    plain = LLM(dtype="bfloat16", **kw)  # type: ignore[arg-type]
    wide = LLM(dtype="bfloat16", residual_dtype="float32", **kw)  # type: ignore[arg-type]
    ref = LLM(dtype="float32", **kw)  # type: ignore[arg-type]
    weights = plain.model.state_dict()
    wide.model.load_state_dict(weights)
    ref.model.load_state_dict({k: v.float() for k, v in weights.items()})
    assert wide.info.residual_dtype == "float32" and plain.info.residual_dtype == "bfloat16"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(8, 97))] for _ in range(16)]
    truth = last_logits(ref, prompts)
    err_plain = [rel_err(a, r) for a, r in zip(last_logits(plain, prompts), truth, strict=True)]
    err_wide = [rel_err(a, r) for a, r in zip(last_logits(wide, prompts), truth, strict=True)]
    print(
        f"mean error: float32 stream {statistics.mean(err_wide):.2e}, usual layout "
        f"{statistics.mean(err_plain):.2e}, ratio of sums {sum(err_wide) / sum(err_plain):.3f}"
    )
    # The usual layout rounds the whole stream to bfloat16 after each of its 60 adds, on top of
    # the roundings both layouts share (each sublayer's inputs and outputs, the final norm, the
    # logits). Measured with these weights, over four sets of 16 prompts (2026-12-07, one Xeon
    # with AMX): float32-stream mean error 2.4e-2, usual layout 3.7e-2, ratio of sums 0.60 to
    # 0.69; these 16 prompts gave 0.655 / 0.657 / 0.657 under ATEN_CPU_CAPABILITY avx2 / avx512
    # / the default. Random weights err more than SmolLM2's (5e-3 there), so the bounds are: a mean
    # error well below 1 (a layout bug gives errors of order 1), and 0.85 of the usual layout's
    # summed error.
    assert statistics.mean(err_wide) <= 0.1, (err_wide, err_plain)
    assert sum(err_wide) <= 0.85 * sum(err_plain), (err_wide, err_plain)
