"""chunked: chunked vs unchunked prefill, greedy tokens of 32 prompts."""

from __future__ import annotations

import random

from engine import LLM
from scripts.gpu_check import common
from scripts.gpu_check.common import (
    CHUNK_HEADERS,
    CHUNK_PROMPTS,
    chunk_rows,
    free,
    qwen_engine,
    rand_ids,
    wide_dir,
)
from scripts.gpu_check.report import Report


def sec_chunked(r: Report) -> None:
    rows = []
    rng = random.Random(7)
    prompts = [rand_ids(rng.randint(200, 1200), rng) for _ in range(CHUNK_PROMPTS)]
    wide = LLM(
        model=str(wide_dir(r)),
        device=common.DEV,
        progress=False,
        max_seq_len=2048,
        max_running_req=32,
        num_pages=65536,
        cache_type="naive",
    )
    rows += chunk_rows(wide, prompts, "wide random Qwen3 (4 layers)")
    del wide
    free()
    for extra, label in (
        ({}, ""),
        ({"residual_dtype": "float32"}, ", float32 residual"),
        ({"batch_invariant": True}, ", batch-invariant"),
    ):
        llm = qwen_engine(max_running_req=32, num_pages=65536, cache_type="naive", **extra)
        rows += chunk_rows(llm, prompts, f"Qwen3-0.6B shape, random{label}")
        del llm
        free()
    r.data["chunked"] = rows
    r.table(
        f"Chunked against unchunked prefill (budget 8192), greedy, first 32 tokens of "
        f"{CHUNK_PROMPTS} prompts of 200-1200 tokens",
        CHUNK_HEADERS,
        rows,
    )
