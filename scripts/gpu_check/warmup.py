"""warmup: build FlashInfer's JIT kernels in parallel threads (norm, RoPE, SiLU, attention)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from scripts.gpu_check.report import Report


def sec_warmup(r: Report) -> None:
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module

    bf = torch.bfloat16
    specs = {
        "norm": gen_norm_module(),
        "rope": gen_rope_module(),
        "silu_and_mul": gen_act_and_mul_module("silu"),
        "attention d128": gen_batch_prefill_module(
            "fa2", bf, bf, bf, torch.int32, 128, 128, 0, False, False, False
        ),
        "attention d64": gen_batch_prefill_module(
            "fa2", bf, bf, bf, torch.int32, 64, 64, 0, False, False, False
        ),
        # the CUDA-core decode kernel (FlashInferAttention below 4 query heads per KV head)
        "decode d128": gen_batch_decode_module(bf, bf, bf, torch.int32, 128, 128, 0, False, False),
        "decode d64": gen_batch_decode_module(bf, bf, bf, torch.int32, 64, 64, 0, False, False),
    }
    times: dict[str, float] = {}

    def build(item: tuple[str, Any]) -> None:
        name, spec = item
        t = time.perf_counter()
        spec.build(verbose=False)
        times[name] = time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(specs)) as ex:
        list(ex.map(build, specs.items()))
    times["all (parallel)"] = time.perf_counter() - t0
    r.data["warmup_s"] = times
    r.table("FlashInfer JIT builds", ["module", "seconds"], [[k, v] for k, v in times.items()])
