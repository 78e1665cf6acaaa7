"""exactness: does the GPU engine compute what it should? Chunked against unchunked greedy
tokens (with the piecewise graphs, a float32 residual, batch-invariant); the engine's logits
against Hugging Face's on the same weights; FlashInfer against torch attention inside the
engine, per step kind; then the same on SmolLM2's real weights when they are here."""

from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu import common
from bench.gpu.common import (
    QWEN,
    QWEN_VOCAB,
    Report,
    flashinfer_missing,
    free,
    qwen_engine,
    rand_ids,
)
from bench.gpu.compare import (
    BACKEND_HEADERS,
    CHUNK_HEADERS,
    CHUNK_PROMPTS,
    LOGITS_HEADERS,
    backend_rows,
    chunk_rows,
    logits_table_rows,
)
from bench.gpu.hf import hf_from_engine
from bench.gpu.real_weights import run as real_weights
from engine import LLM
from engine.runner import ModelRunner

# 65,536 tokens of KV in pages of 16: the largest workload here (32 prompts of up to 1,240
# tokens) with room to spare, a few GB at these shapes
POOL: dict[str, Any] = {"page_size": 16, "num_pages": 4096}


def wide_model(tmp: Path) -> Path:
    """A 4-layer random Qwen3 with FlashInfer-sized heads and clear greedy margins."""
    from checks.models import make_wide_model
    from engine.models.loader import resolve

    return make_wide_model(tmp / "wide", resolve("smollm2", progress=False).path, num_layers=4)


def run(r: Report, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wide = wide_model(Path(tmp))

        def make_wide(**kw: Any) -> LLM:
            args = dict(model=str(wide), device=common.DEV, progress=False, max_seq_len=2048)
            return LLM(**{**args, **POOL, **kw})

        chunked(r, make_wide)
        if r.left() > 120:
            logits(r)
        if flashinfer_missing() is None and r.left() > 60:
            rows = backend_rows(
                "Qwen3-0.6B shape, random", lambda **kw: qwen_engine(**POOL, **kw), QWEN_VOCAB, 5
            )
            rows += backend_rows("wide random Qwen3 (4 layers)", make_wide, 49152, 6)
            r.data["backends"] = rows
            r.table("FlashInfer against torch attention inside the engine (both bf16; "
                    "FlashInfer with graphs)", BACKEND_HEADERS, rows)  # fmt: skip
    if r.left() > 120:
        real_weights(r)


def chunked(r: Report, make_wide: Callable[..., LLM]) -> None:
    rng = random.Random(7)
    prompts = [rand_ids(rng.randint(200, 1200), rng) for _ in range(CHUNK_PROMPTS)]
    kw: dict[str, Any] = dict(max_running_req=32, cache_type="naive", **POOL)
    rows = chunk_rows(make_wide(**kw), prompts, "wide random Qwen3 (4 layers)")
    free()
    for extra, label in (({}, ""), ({"residual_dtype": "float32"}, ", float32 residual"),
                         ({"batch_invariant": True}, ", batch-invariant"), (None, ", piecewise "
                         "graphs off (prefill and mixed steps eager)")):  # fmt: skip
        if r.left() < 60:
            r.say(f"(skipped chunked{label}: past the deadline)")
            continue
        saved = ModelRunner.piecewise_max_tokens
        if extra is None:
            ModelRunner.piecewise_max_tokens = 0
        try:
            llm = qwen_engine(**kw, **(extra or {}))
        finally:
            ModelRunner.piecewise_max_tokens = saved
        rows += chunk_rows(llm, prompts, f"Qwen3-0.6B shape, random{label}")
        del llm
        free()
    r.data["chunked"] = rows
    r.table(
        f"Chunked against unchunked prefill (budget 8192), greedy, the first 32 tokens of "
        f"{CHUNK_PROMPTS} prompts of 200-1,200 tokens",
        CHUNK_HEADERS,
        rows,
    )


def logits(r: Report) -> None:
    llm = qwen_engine(max_running_req=16, **POOL)
    hf32 = hf_from_engine(llm, torch.float32, QWEN)
    hf16 = hf_from_engine(llm, torch.bfloat16, QWEN)
    del llm
    prompts = [rand_ids(n, random.Random(n), QWEN_VOCAB) for n in (16, 512, 1500)]
    rows, raw = logits_table_rows(
        "Qwen3-0.6B shape, random",
        lambda **kw: qwen_engine(**{"max_running_req": 16, **POOL, **kw}),
        hf32, hf16, prompts, QWEN_VOCAB,
    )  # fmt: skip
    r.data["logits"] = raw
    r.table("Logits against Hugging Face on the same (bf16) weights", LOGITS_HEADERS, rows)
    r.say(
        "Relative error = ||engine - HF|| / ||HF|| of one position's logits, worst over prompts "
        "of 16, 512 and 1,500 tokens (prefill: the prompt's last position; decode: the 7 steps "
        "after it); target <= 1e-2."
    )
    del hf32, hf16
    free()
