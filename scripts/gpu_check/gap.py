"""gap: issue 17's SmolLM2 logits gap: a SmolLM2-shaped model's logits per attention backend
against HF, then FlashInfer's attention alone (gap_attention.py).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine import LLM
from engine.checks.greedy import (
    trace_run,
)
from instrumentation.sampling import SamplingParams
from scripts.gpu_check import common
from scripts.gpu_check.common import free, hf_from_engine, logits_rows, notes_prompts, rand_ids
from scripts.gpu_check.gap_attention import (
    CHUNK,
    CHUNK_VARIANTS,
    DECODE_VARIANTS,
    FP16_QK_NOTE,
    PREFILL_VARIANTS,
    SLOW_VARIANTS,
    AttnBench,
    _attention_table,
    _floor_row,
    attention_ref,
    flashinfer_no_split,
    gap_inputs,
    run_attention_variants,
    variant_kind,
)
from scripts.gpu_check.logits import logits_rows_hf
from scripts.gpu_check.report import Report, _fmt
from scripts.gpu_check.smollm2 import smollm2_path

# -- the SmolLM2 logits gap (issue 17) -------------------------------------------------------
SMOL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PEAK = 4.0  # q and k rows of qkv_proj scaled by this (exact in bf16): scores x 16, peaked softmax


def smol_dir(r: Report) -> Path:
    """A config-only directory of SmolLM2-135M's shape (the engine draws N(0, 0.02) weights,
    norms 1, with load_format="dummy"; the tokenizer is the bundled one, as for Qwen3)."""
    if "smol_dir" not in r.data:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="smol-shape-"))
        (path / "config.json").write_text(json.dumps(SMOL_CONFIG, indent=1))
        r.data["smol_dir"] = str(path)
    return Path(r.data["smol_dir"])


def sharpen(llm: LLM, factor: float) -> None:
    """Scale every layer's q and k projections in place (CUDA graphs read the same storage)."""
    m = llm.model_config
    qk = (m.num_heads + m.num_kv_heads) * m.head_dim
    with torch.no_grad():
        for name, p in llm.model.named_parameters():
            if name.endswith("self_attn.qkv_proj.weight"):
                p[:qk].mul_(factor)


def capture_qkv(llm: LLM, prompt: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's post-RoPE (q, k, v) of one prompt's prefill, from an engine whose attention
    backend is called from Python (torch backend, no graphs)."""
    backend = llm.runner.backend
    got: dict[int, tuple[torch.Tensor, ...]] = {}
    forward = backend.forward

    def tap(q: Any, k: Any, v: Any, layer: int, meta: Any) -> Any:
        if q.shape[0] > 1 and layer not in got:  # bf16 as the engine's kernels get them on CUDA
            got[layer] = tuple(x.to(torch.bfloat16).contiguous() for x in (q, k, v))
        return forward(q, k, v, layer, meta)

    backend.forward = tap  # type: ignore[method-assign]
    try:
        trace_run(llm, [prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        del backend.forward
    if not got:
        raise RuntimeError("no prefill was seen (a prefix-cache hit? use cache_type='naive')")
    return [got[i] for i in sorted(got)]


LOGITS_GAP_HEADERS = [
    "model",
    "step",
    "FlashInfer (default) vs HF fp32",
    "FlashInfer, split-KV off, vs HF fp32",
    "FlashInfer, page 1, vs HF fp32",
    "Triton attention vs HF fp32",
    "torch attention vs HF fp32",
    "FlashInfer (default) vs HF bf16",
    "HF bf16 (sdpa) vs HF fp32",
]


def gap_models(r: Report) -> list[tuple[str, Callable[..., LLM], Path]]:
    """(name, make(**kw) -> LLM, config dir) of the models the gap section compares."""
    base: dict[str, Any] = dict(
        device=common.DEV, progress=False, max_running_req=4, page_size=16, num_pages=1024,
        max_seq_len=2048, max_extend_tokens=CHUNK, cache_type="naive",
    )  # fmt: skip
    smol = smol_dir(r)

    def random_model(peak: float) -> Callable[..., LLM]:
        def make(**kw: Any) -> LLM:
            llm = LLM(model=str(smol), load_format="dummy", **{**base, **kw})
            if peak != 1.0:
                sharpen(llm, peak)
            return llm

        return make

    models = [
        ("SmolLM2-135M shape, random N(0, 0.02)", random_model(1.0), smol),
        (f"the same, q and k x{PEAK:g} (peaked attention)", random_model(PEAK), smol),
    ]
    real = smollm2_path()
    if real is not None:
        models.append(
            (
                "SmolLM2-135M-Instruct (real weights)",
                lambda **kw: LLM(model=str(real), **{**base, **kw}),
                real,
            )
        )
    return models


def gap_logits(
    r: Report, name: str, make: Callable[..., LLM], cfg_dir: Path, prompts: list[list[int]]
) -> tuple[list[list[Any]], dict[str, Any]]:
    first = make()
    hf32 = hf_from_engine(first, torch.float32, cfg_dir)
    hf16 = hf_from_engine(first, torch.bfloat16, cfg_dir)
    del first
    free()
    raw: dict[str, Any] = {}
    for key, kw, refs, nosplit in (
        ("flashinfer", {}, {"fp32": hf32, "bf16": hf16}, False),
        ("nosplit", {}, {"fp32": hf32}, True),
        ("page1", {"page_size": 1, "num_pages": 16384}, {"fp32": hf32}, False),
        ("triton", {"attention_backend": "triton"}, {"fp32": hf32}, False),
        ("torch", {"attention_backend": "torch", "cuda_graph": False}, {"fp32": hf32}, False),
    ):
        if r.left() < 30:
            r.say(f"(skipped {name} {key}: out of time)")
            continue
        try:
            with flashinfer_no_split() if nosplit else contextlib.nullcontext():
                llm = make(**kw)
                raw[key] = logits_rows(llm, refs, prompts)
            del llm
        except Exception as e:
            raw[key] = {"error": f"{type(e).__name__}: {e}"[:200]}
            print(traceback.format_exc(), flush=True)
        free()
    raw["hf_bf16_vs_fp32"] = logits_rows_hf(hf16, hf32, prompts, hf32.config.vocab_size)
    del hf32, hf16
    free()

    def cell(key: str, col: str) -> Any:
        v = raw.get(key, {})
        return v.get(col, v.get("error", "")) if isinstance(v, dict) else ""

    rows = [
        [
            name,
            kind,
            cell("flashinfer", f"fp32 {kind}"),
            cell("nosplit", f"fp32 {kind}"),
            cell("page1", f"fp32 {kind}"),
            cell("triton", f"fp32 {kind}"),
            cell("torch", f"fp32 {kind}"),
            cell("flashinfer", f"bf16 {kind}"),
            raw["hf_bf16_vs_fp32"][kind],
        ]
        for kind in ("prefill", "decode")
    ]
    return rows, raw


def sec_gap(r: Report) -> None:
    """Issue 17's SmolLM2 logits gap: the engine's attention backends against Hugging Face on a
    SmolLM2-135M-shaped model, then FlashInfer's attention alone, one planning choice at a time,
    against a float64 reference."""
    bench = AttnBench()
    data: dict[str, Any] = {}
    # 1. attention alone: synthetic inputs, then every layer of a prompt through a model
    sets: dict[str, list[tuple[torch.Tensor, ...]]] = {n: [x] for n, x in gap_inputs().items()}
    models = gap_models(r)
    cap_name, cap_make, _ = models[-1]  # the real model if here, else the peaked random one
    try:
        llm = cap_make(attention_backend="torch", cuda_graph=False, max_extend_tokens=4096)
        prompt = notes_prompts(llm, 1)[0] if "real" in cap_name else rand_ids(512, random.Random(1))
        sets[f"{cap_name}: every layer, {len(prompt)}-token prompt"] = capture_qkv(llm, prompt)
        del llm
        free()
    except Exception:
        print(traceback.format_exc(), flush=True)
        r.say("(capturing a model's q, k, v failed; synthetic inputs only)")
    refs = {n: [attention_ref(q, k, v) for q, k, v in layers] for n, layers in sets.items()}
    results: dict[str, dict[str, Any]] = {}
    for set_name, res in _floor_row(refs).items():
        results.setdefault(set_name, {})["float64 reference rounded to bf16 (output floor)"] = res
    run_attention_variants(
        bench, sets, refs, PREFILL_VARIANTS + CHUNK_VARIANTS + DECODE_VARIANTS, results, r.left
    )
    data["attention"] = results
    r.data["gap"] = data
    _attention_table(
        r,
        "SmolLM2 attention alone (9 q heads, 3 KV heads, head dim 64, bf16) against a float64 "
        "reference",
        results,
    )
    r.say(FP16_QK_NOTE)
    r.save()
    # 2. the whole model against Hugging Face
    prompts = [rand_ids(512, random.Random(512)), rand_ids(1500, random.Random(1500))]
    rows: list[list[Any]] = []
    for name, make, cfg_dir in models:
        if r.left() < 60:
            r.say(f"(skipped model {name}: out of time)")
            continue
        try:
            mp = prompts
            if "real" in name:
                probe = make()
                question = probe.encode("What is the capital of France?", chat=True)
                mp = [*notes_prompts(probe, 2), question]
                del probe
                free()
            mrows, raw = gap_logits(r, name, make, cfg_dir, mp)
        except Exception as e:
            print(traceback.format_exc(), flush=True)
            mrows, raw = [[name, "failed", f"{type(e).__name__}: {e}"[:200], *[""] * 6]], {}
            free()
        rows += mrows
        data.setdefault("logits", {})[name] = raw
        r.save()
    r.table(
        "SmolLM2 shape: last-position (prefill) and decode logits against Hugging Face on the "
        f"same bf16 weights; prompts prefilled {CHUNK} tokens a step (the engine's default "
        "budget, as in the issue's measurement)",
        LOGITS_GAP_HEADERS,
        rows,
    )
    r.say(gap_verdict(results, {}, rows))
    r.save()  # what follows compiles kernels for minutes at worst
    # 3. variants that need their own JIT build
    slow: dict[str, dict[str, Any]] = {}
    for variant in SLOW_VARIANTS:
        if r.left() < 120:
            r.say(f"(skipped {variant[0]}: out of time)")
            continue
        t = time.perf_counter()
        run_attention_variants(bench, sets, refs, [variant], slow)
        print(f"{variant[0]}: {time.perf_counter() - t:.0f} s with its JIT build", flush=True)
        data["attention_jit"] = slow
        r.save()
    if slow:
        _attention_table(r, "The same, variants with their own JIT build", slow)
        backends = {res.get("backend") for per in slow.values() for res in per.values()} - {None}
        if backends:
            r.say(f'backend="auto" resolved to {", ".join(sorted(map(str, backends)))}.')
        r.say(gap_verdict(results, slow, []))


def gap_verdict(
    results: dict[str, dict[str, Any]],
    slow: dict[str, dict[str, Any]],
    rows: list[list[Any]],
) -> str:
    """The section's conclusion from the numbers: how each variant's error at the last position
    compares with the engine's plan (only `slow`'s variants when it is not empty)."""
    keys = {
        "prefill": PREFILL_VARIANTS[0][0],
        "chunk": CHUNK_VARIANTS[0][0],
        "decode": DECODE_VARIANTS[0][0],
    }
    lines = [
        "**What moves the error** (last position, worst head; the engine's FlashInferAttention "
        "over the variant, each against the engine's own call of the same kind: whole prompt, "
        "last chunk, decode):"
    ]
    for set_name, per in results.items():
        base = {kind: per.get(key, {}).get("last") for kind, key in keys.items()}
        if base["prefill"] is None:
            continue
        parts = []
        for name, res in (slow.get(set_name, {}) if slow else per).items():
            b = base[variant_kind(name)]
            if name in keys.values() or "last" not in res or b is None:
                continue
            ratio = b / max(res["last"], 1e-30)
            floor = name.startswith("float64")
            mark = " **moves it**" if not floor and (ratio > 1.5 or ratio < 1 / 1.5) else ""
            parts.append(f"{name.strip()}: {res['last']:.2e} ({ratio:.2f}x){mark}")
        if parts and not any("moves it" in p for p in parts):
            parts.append("nothing moves it by more than 1.5x")
        more = "".join(
            f", {kind} {base[kind]:.2e}" for kind in ("chunk", "decode") if base[kind] is not None
        )
        lines.append(
            f"- {set_name}: the engine's FlashInfer, prefill {base['prefill']:.2e}{more}; "
            + "; ".join(parts)
        )
    for row in rows:
        if row[1] == "prefill":
            lines.append(
                f"- model {row[0]}, prefill logits vs HF fp32: FlashInfer {_fmt(row[2])}, "
                f"split-KV off {_fmt(row[3])}, page 1 {_fmt(row[4])}, Triton {_fmt(row[5])}, "
                f"torch {_fmt(row[6])}, HF bf16 {_fmt(row[8])}"
            )
    return "\n".join(lines)
