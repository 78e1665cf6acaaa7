"""backends: FlashInfer vs torch attention inside the engine, per step kind
(prefill/mixed/decode).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from engine import LLM
from scripts.gpu_check import common
from scripts.gpu_check.common import (
    BACKEND_HEADERS,
    QWEN_VOCAB,
    compare_phases,
    free,
    phase_trace,
    qwen_engine,
    rand_ids,
    wide_dir,
)
from scripts.gpu_check.report import Report


def sec_backends(r: Report) -> None:
    rows = []
    rng = random.Random(5)
    cases: list[tuple[str, Callable[..., LLM], int]] = [
        ("Qwen3-0.6B shape, random", qwen_engine, QWEN_VOCAB),
        (
            "wide random Qwen3 (4 layers)",
            lambda **kw: LLM(
                model=str(wide_dir(r)), device=common.DEV, progress=False, max_seq_len=2048, **kw
            ),
            49152,
        ),
    ]
    for name, make, vocab in cases:
        prompts = [rand_ids(100, rng, vocab), rand_ids(150, rng, vocab)]
        late = rand_ids(700, rng, vocab)
        fi = make(max_running_req=16, num_pages=16384)
        a = phase_trace(fi, prompts, late)
        del fi
        free()
        ref = make(max_running_req=16, num_pages=16384, attention_backend="torch", cuda_graph=False)
        b = phase_trace(ref, prompts, late)
        del ref
        free()
        for phase, errs in compare_phases(b, a).items():
            rows.append([name, phase, len(errs), max(errs)])
    r.data["backends"] = rows
    r.table(
        "FlashInfer against torch attention inside the engine (both bf16; FlashInfer with graphs)",
        BACKEND_HEADERS,
        rows,
    )
