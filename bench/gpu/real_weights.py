"""The exactness section on real weights: the bundled SmolLM2-135M-Instruct (when its weights
are here; $SMOLLM2_GGUF converts a copy of its GGUF once). Greedy tokens of engine variants
against Hugging Face generate on the same weights, logits against Hugging Face, chunked
against unchunked, FlashInfer against torch attention."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import notes_prompts
from bench.gpu import common
from bench.gpu.common import Report, flashinfer_missing, free, rand_ids
from bench.gpu.compare import (
    BACKEND_HEADERS,
    CHUNK_HEADERS,
    CHUNK_PROMPTS,
    LOGITS_HEADERS,
    chunk_rows,
    compare_phases,
    logits_table_rows,
    phase_trace,
)
from bench.gpu.hf import bf16_rounded, hf_logits
from checks.greedy import TIE_NOISE, Trace, tie_margin, trace_run
from checks.kernels import gemv_pinned
from engine import LLM
from engine.models.kernels import DECODE_KERNELS, set_unfused
from engine.models.loader import BUNDLED_NAME, cache_root, convert_gguf
from instrumentation.sampling import SamplingParams

NAME = "SmolLM2-135M-Instruct"
GREEDY_PROMPTS, GREEDY_TOKENS = 16, 32  # the chat question and this many notes prompts


@dataclasses.dataclass(frozen=True)
class GreedyVariant:
    """One engine run of the greedy comparison."""

    name: str
    llm_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    unfused: tuple[str, ...] = ()  # decode kernels turned off (engine.models.kernels)
    serial: bool = False  # one prompt at a time: the 1-row graph
    gemv_everywhere: bool = False  # every weight's 1-row matmul through engine/kernels/gemv.py


# SmolLM2's head shape has no tuned decode table and its matmuls none either, so at 17 rows its
# graphs run FlashInfer's decode and cuBLAS. One prompt at a time the 1-row graph runs the decode
# kernel (CUDA cores) and the fused qkv epilogue; with the GEMVs forced on every weight the norms
# fold into them as well: every fused decode kernel, on real weights.
FLOAT32 = {"dtype": "float32", "attention_backend": "torch", "cuda_graph": False}
GREEDY_VARIANTS = (
    GreedyVariant("default (bf16)"),
    GreedyVariant("bf16, fused decode kernels off", unfused=DECODE_KERNELS),
    GreedyVariant("float32 (torch attention)", FLOAT32),
    GreedyVariant("default (bf16), one prompt at a time", serial=True),
    GreedyVariant("bf16, one at a time, the GEMVs on every weight", serial=True,
                  gemv_everywhere=True),
    GreedyVariant("bf16, fused decode kernels off, one at a time", unfused=DECODE_KERNELS,
                  serial=True),
)  # fmt: skip


def smollm2_path() -> Path | None:
    """The converted SmolLM2 directory, converting $SMOLLM2_GGUF once if given; None when only
    a tokenizer is here."""
    target = cache_root() / BUNDLED_NAME
    gguf = os.environ.get("SMOLLM2_GGUF")
    if gguf and not (target / "model.safetensors").is_file():
        convert_gguf(Path(gguf), target, progress=False)
    return target if (target / "model.safetensors").is_file() else None


def run(r: Report) -> None:
    path = smollm2_path()
    if path is None:
        r.say(f"\n### {NAME}\n\nNot run: its weights are not on this machine.\n")
        return
    from transformers import AutoModelForCausalLM

    def make(**kw: Any) -> LLM:
        args: dict[str, Any] = dict(
            model=str(path), device=common.DEV, progress=False, max_running_req=32, page_size=16,
            num_pages=4096,
            max_seq_len=2048, cache_type="naive",
        )  # fmt: skip
        return LLM(**{**args, **kw})

    llm = make()
    question = "What is the capital of France?"
    answer = llm.generate([question], SamplingParams(max_tokens=16), chat=True)[0]["text"]
    prompts = notes_prompts(llm, CHUNK_PROMPTS)
    greedy_prompts = [llm.encode(question, chat=True), *prompts[:GREEDY_PROMPTS]]
    hf32 = bf16_rounded(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    hf32 = hf32.to(common.DEV).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(common.DEV).eval()
    greedy(r, llm, make, path, greedy_prompts, hf16, hf32)
    r.say(f"Greedy chat answer on the GPU to {question!r}: {answer!r}")
    if r.left() < 90:
        r.say(f"({NAME}: logits, chunked and backends skipped: past the deadline)")
        return
    rows, raw = logits_table_rows(NAME, make, hf32, hf16, [*prompts[:3], greedy_prompts[0]],
                                  hf32.config.vocab_size)  # fmt: skip
    r.table(f"{NAME}: logits against Hugging Face on the same (bf16) weights", LOGITS_HEADERS, rows)
    del hf32, hf16
    crow = chunk_rows(llm, prompts, NAME)
    del llm
    free()
    inv = make(batch_invariant=True)
    crow += chunk_rows(inv, prompts, f"{NAME}, batch-invariant")
    del inv
    free()
    r.table(
        f"{NAME}: chunked against unchunked prefill (budget 8192), greedy, the first 32 tokens "
        f"of {CHUNK_PROMPTS} chat prompts (150-900 tokens)",
        CHUNK_HEADERS,
        crow,
    )
    r.data["real_weights"] = {"logits": raw, "chunked": crow, "answer": answer}
    if flashinfer_missing() is not None or r.left() < 60:
        return
    late = rand_ids(700, random.Random(9))
    a = phase_trace(make(max_running_req=16), prompts[:2], late)
    free()
    ref = make(max_running_req=16, attention_backend="torch", cuda_graph=False)
    b = phase_trace(ref, prompts[:2], late)
    del ref
    free()
    brows = [[NAME, ph, len(e), max(e)] for ph, e in compare_phases(b, a).items()]
    r.table(f"{NAME}: FlashInfer against torch attention inside the engine", BACKEND_HEADERS, brows)
    r.data["real_weights"]["backends"] = brows


def greedy(
    r: Report,
    llm: LLM,
    make: Callable[..., LLM],
    path: Path,
    prompts: list[list[int]],
    hf16: Any,
    hf32: Any,
) -> None:
    """Each greedy variant's tokens against Hugging Face generate's: a summary and a detail table."""
    params = SamplingParams(max_tokens=GREEDY_TOKENS)
    runs = {GREEDY_VARIANTS[0].name: trace_run(llm, prompts, params)}
    for v in GREEDY_VARIANTS[1:]:
        if r.left() < 60:
            r.say(f"(skipped greedy {v.name}: past the deadline)")
            continue
        set_unfused(list(v.unfused))
        pinned = gemv_pinned(path, (1,), one_row_gemv()) if v.gemv_everywhere else None
        with pinned or contextlib.nullcontext():
            try:
                other = make(**v.llm_args)
                if other.dtype == torch.float32:  # HF fp32's weights: the bf16-rounded ones
                    bf16_rounded(other.model)
                if v.serial:
                    runs[v.name] = [trace_run(other, [p], params)[0] for p in prompts]
                    r.say(f"{v.name}: the 1-row graph runs {one_row_kernels(other)}.")
                else:
                    runs[v.name] = trace_run(other, prompts, params)
                del other
            finally:
                set_unfused([])
        free()
    summary, detail, raw = greedy_tables(prompts, runs, hf16, hf32)
    r.table(
        f"{NAME}: greedy tokens against Hugging Face generate on the same weights, the chat "
        f"question and {GREEDY_PROMPTS} notes prompts, {GREEDY_TOKENS} new tokens (fewer where "
        "one stops at EOS). Where a run parts from HF fp32's tokens, its inputs are still HF "
        "fp32's: a near-tie when HF fp32's logits of the two tokens there differ by at most "
        f"{TIE_NOISE:g}x the RMS of the run's and HF fp32's logit difference at that position "
        "(the rule of the GPU tests' compare_greedy); a mismatch otherwise",
        GREEDY_SUMMARY_HEADERS,
        summary,
    )
    r.table(
        f"{NAME}: per prompt, where each run parts from HF fp32's greedy tokens "
        "(step: fp32 top-2 gap / RMS logit difference there)",
        ["prompt", "tokens", *runs, "HF bf16"],
        detail,
    )
    r.data["real_weights_greedy"] = raw


def one_row_gemv() -> Any:
    """A GEMV configuration for one row that folds the norm before it (split 1, no dot)."""
    from engine.kernels.gemv import Config

    return Config(block_n=4, block_k=256)


def one_row_kernels(llm: LLM) -> str:
    """Which fused decode kernels the engine's 1-row decode graph was captured with."""
    from engine.kernels import gemv as G
    from engine.models.kernels import device_name, skinny_gemv

    graphs = llm.runner.graphs
    meta = None if graphs is None else graphs.metas.get(1)
    decode = (
        "this decode kernel" if getattr(meta, "decode", None) is not None else "FlashInfer's decode"
    )
    x = torch.empty(1, llm.model_config.hidden_size, dtype=llm.dtype, device=llm.device)
    on = skinny_gemv(x) is not None
    dev = device_name(llm.device) if llm.device.type == "cuda" else None
    weights = [w for n, w in llm.model.named_parameters() if w.dim() == 2 and "embed" not in n]
    mats = sum(on and G.choose(*w.shape, 1, dev) is not None for w in weights)
    return (
        f"{decode}, and the GEMV for {mats} of its {len(weights)} weight matrices (cuBLAS the rest)"
    )


GREEDY_SUMMARY_HEADERS = [
    "run",
    "prompts",
    "= HF bf16",
    "= HF fp32",
    "parts from fp32 at a near-tie",
    "parts from fp32 at a clear winner (mismatch)",
    "largest fp32 top-2 gap where it parts",
]


def greedy_verdict(
    ref: Any, ids: list[int], want: list[int], got: list[int], row: Callable[[int], torch.Tensor]
) -> dict[str, Any]:
    """Where `got` (a run's greedy tokens after `ids`) parts from `want` (the reference model
    `ref`'s), and whether that is a near-tie: the reference's logits of the two tokens at that
    position (inputs identical up to it) differ by at most TIE_NOISE times the RMS of the
    reference's and the run's logits difference there; `row(j)` is the run's logits at step j."""
    n = min(len(want), len(got))
    j = next((t for t in range(n) if want[t] != got[t]), None)
    if j is None:
        return {"n": n, "diverge": None, "verdict": "same"}
    ref_row, run_row = hf_logits(ref, ids + got[:j], 1)[0], row(j).float().cpu()
    gap, noise = tie_margin(ref_row, run_row, want[j], got[j])
    verdict = "tie" if gap <= TIE_NOISE * noise else "mismatch"
    return {"n": n, "diverge": j, "gap": gap, "noise": noise, "verdict": verdict}


def greedy_tables(
    prompts: list[list[int]], runs: dict[str, list[Trace]], hf16: Any, hf32: Any
) -> tuple[list[list[Any]], list[list[Any]], dict[str, Any]]:
    """Each engine run's greedy tokens, and HF bf16's, against HF fp32's (with the verdict of
    `greedy_verdict` where they part) and against HF bf16's: a summary row per run, a detail
    row per prompt."""

    def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            x = torch.tensor([ids], device=common.DEV)
            out = model.generate(x, max_new_tokens=n, do_sample=False, top_p=None, top_k=None)
        return out[0, len(ids) :].tolist()

    n_new = max(len(t.tokens) for run in runs.values() for t in run)
    b16 = [hf_greedy(hf16, ids, n_new) for ids in prompts]
    b32 = [hf_greedy(hf32, ids, n_new) for ids in prompts]
    verdicts: dict[str, list[dict[str, Any]]] = {}
    same16: dict[str, list[bool]] = {}
    for name, run in runs.items():
        verdicts[name] = [
            greedy_verdict(hf32, ids, want, t.tokens, lambda j, t=t: t.logits[j])
            for ids, want, t in zip(prompts, b32, run, strict=True)
        ]
        same16[name] = [
            t.tokens[: (k := min(len(t.tokens), len(b)))] == b[:k]
            for t, b in zip(run, b16, strict=True)
        ]
    verdicts["HF bf16"] = [
        greedy_verdict(
            hf32, ids, want, got, lambda j, ids=ids, got=got: hf_logits(hf16, ids + got[:j], 1)[0]
        )  # fmt: skip
        for ids, want, got in zip(prompts, b32, b16, strict=True)
    ]
    same16["HF bf16"] = [True] * len(prompts)
    summary = []
    for name, vs in verdicts.items():
        gaps = [v["gap"] for v in vs if v["diverge"] is not None]
        summary.append([
            name,
            len(vs),
            sum(same16[name]),
            sum(v["verdict"] == "same" for v in vs),
            sum(v["verdict"] == "tie" for v in vs),
            sum(v["verdict"] == "mismatch" for v in vs),
            max(gaps) if gaps else "-",
        ])  # fmt: skip

    def cell(v: dict[str, Any]) -> str:
        if v["diverge"] is None:
            return "="
        what = "tie" if v["verdict"] == "tie" else "MISMATCH"
        return f"{what} at {v['diverge']} ({v['gap']:.3f} / {v['noise']:.3f})"

    detail = []
    for i, ids in enumerate(prompts):
        name = "chat question" if i == 0 else f"notes {i} ({len(ids)} tokens)"
        n = min(v[i]["n"] for v in verdicts.values())
        detail.append([name, n, *(cell(v[i]) for v in verdicts.values())])
    raw = {"verdicts": verdicts, "same_bf16": same16, "hf_bf16": b16, "hf_fp32": b32}
    return summary, detail, raw
