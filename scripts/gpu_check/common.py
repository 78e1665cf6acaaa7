"""What the sections share: the models they build (random-weight Qwen3-0.6B shapes), the
Hugging Face references, the prompts, and the timing of engine steps.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine import LLM
from engine.checks.greedy import (
    LogitTap,
    compare_greedy,
    rel_err,
    trace_run,
)
from engine.checks.models import make_wide_model
from engine.detokenizer import IncrementalDetokenizer
from engine.kvcache.pool import KVPool
from engine.models.loader import resolve
from instrumentation.sampling import SamplingParams
from scripts.gpu_check.report import Report

REPO = Path(__file__).resolve().parents[2]

QWEN = REPO / "assets" / "qwen3-0.6b"
QWEN_VOCAB = 151936
DEV = "cuda"  # one name for the device, so a CPU dry run of the script's logic can swap it
BATCHES = (1, 16, 64, 256)
PROMPT_LEN, NEW_TOKENS = 512, 128
LONG_PROMPT, DECODERS = 8000, 32  # the stall table's arriving prompt and decoding requests
LONG_CONTEXT = 4096  # the bench's long-context row (batch 16)
CHUNK_PROMPTS = 32  # prompts of the chunked-vs-unchunked comparison
OVERHEAD_ROUNDS = 8
# the decode kernels of engine/kernels, off ("before") and on ("after"): see engine.models.kernels
UNFUSED = ("qkv", "gemv", "fold", "decode")


# -- helpers -------------------------------------------------------------------------------
class FoldedDetokenizer(IncrementalDetokenizer):
    """The engine's detokenizer with every id folded into the bundled tokenizer's vocabulary
    (see the docstring): every token gets text, through the Rust `DecodeStream`, as it would
    for a real model with its own tokenizer."""

    def push(self, token_id: int) -> str:
        return super().push(token_id % self.vocab if self.vocab else token_id)


def qwen_engine(**kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        model=str(QWEN), device=DEV, load_format="dummy", progress=False, max_seq_len=2048
    )
    return LLM(**{**args, **kw})


def free() -> None:
    """Return the memory of models the caller has just dropped (`del`) to the device."""
    gc.collect()
    torch.cuda.empty_cache()


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.model.parameters())  # tied once


def kv_bytes_per_token(llm: LLM) -> int:
    m = llm.model_config
    return KVPool.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, llm.dtype)


def hf_from_engine(llm: LLM, dtype: torch.dtype, config_dir: Path) -> Any:
    """A Hugging Face model holding the engine's weights (merged projections split back)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    m = llm.model_config
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    state: dict[str, torch.Tensor] = {}
    for name, p in llm.model.named_parameters():
        w = p.detach().to(dtype)
        if ".qkv_proj." in name:
            for part, rows in (
                ("q_proj", (0, q)),
                ("k_proj", (q, q + kv)),
                ("v_proj", (q + kv, None)),
            ):
                state[name.replace("qkv_proj", part)] = w[rows[0] : rows[1]]
        elif ".gate_up_proj." in name:
            gate, up = w.chunk(2, dim=0)
            state[name.replace("gate_up_proj", "gate_proj")] = gate
            state[name.replace("gate_up_proj", "up_proj")] = up
        else:
            state[name] = w
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if "lm_head.weight" in missing:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.eval()


def hf_logits(model: Any, ids: list[int], last: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=DEV)).logits[0, -last:].float().cpu()


def bf16_rounded(model: Any) -> Any:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def logits_rows(
    llm: LLM, refs: dict[str, Any], prompts: list[list[int]], new: int = 8
) -> dict[str, float]:
    """Worst relative error of the engine's logits against each reference model, split into the
    prefill's last position and the decode steps after it (CUDA graphs on the engine side)."""
    worst: dict[str, float] = {}
    for prompt in prompts:
        tr = trace_run(llm, [prompt], SamplingParams(max_tokens=new, ignore_eos=True))[0]
        got = torch.stack(tr.logits)
        ids = prompt + tr.tokens
        for ref_name, ref in refs.items():
            want = hf_logits(ref, ids[:-1], len(tr.tokens))
            for kind, sl in (("prefill", slice(0, 1)), ("decode", slice(1, None))):
                err = max(rel_err(g, w) for g, w in zip(got[sl], want[sl], strict=True))
                key = f"{ref_name} {kind}"
                worst[key] = max(worst.get(key, 0.0), err)
    return worst


def phase_trace(llm: LLM, prompts: list[list[int]], late: list[int]) -> list[tuple[str, Any]]:
    """(phase, logits) of every sampling step of a workload that has prefill, mixed and decode
    steps: two prompts start, then a long one arrives while they decode (policy mixed)."""
    llm.set_config(max_extend_tokens=256, policy="mixed")
    steps: list[tuple[str, Any]] = []
    for p in prompts:
        llm.submit(p, SamplingParams(max_tokens=16, ignore_eos=True))
    with LogitTap() as tap:
        n = 0
        while llm.has_work():
            if n == 3:
                llm.submit(late, SamplingParams(max_tokens=4, ignore_eos=True))
            record = llm.step()
            n += 1
            logits = tap.rows_of(record)
            if logits is not None:
                steps.append((record.phase, logits))
    return steps


def compare_phases(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> dict[str, list[float]]:
    """Relative error per phase, up to the first step whose greedy tokens differ."""
    errs: dict[str, list[float]] = {}
    for (pa, la), (pb, lb) in zip(a, b, strict=False):
        if pa != pb or la.shape != lb.shape:
            break
        errs.setdefault(pa, []).append(rel_err(lb, la))
        if not torch.equal(la.argmax(-1), lb.argmax(-1)):
            break
    return errs


def notes_prompts(llm: LLM, n: int) -> list[list[int]]:
    """Chat prompts of 150 to 900 tokens for a real model: notes to summarize."""
    facts = [
        "The river floods every spring after the snow melts in the hills.",
        "Our team meets on Tuesdays to review the open tickets.",
        "The bakery on the corner sells rye bread until noon.",
        "Copper conducts heat far better than stainless steel does.",
        "The museum's east wing reopens after the roof repairs.",
        "Most migratory birds fly south along the coastline.",
        "The train to the airport leaves every twenty minutes.",
        "A good sourdough starter needs flour, water and patience.",
        "The library extended its opening hours during exams.",
        "Solar panels produce less power on cloudy winter days.",
        "The city council approved a new bicycle lane downtown.",
        "Tomatoes ripen faster when stored next to bananas.",
    ]
    out = []
    for i in range(n):
        rng = random.Random(i)
        body = " ".join(rng.choice(facts) for _ in range(rng.randint(10, 65)))
        text = f"Here are my notes:\n{body}\nSummarize the notes in two sentences."
        out.append(llm.encode(text, chat=True))
    return out


def chunk_rows(llm: LLM, prompts: list[list[int]], name: str) -> list[list[Any]]:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm.set_config(max_extend_tokens=8192, policy="prefill_first")
    whole = trace_run(llm, prompts, params)
    rows = []
    for policy, budget in (("prefill_first", 128), ("mixed", 128), ("prefill_first", 64)):
        llm.set_config(max_extend_tokens=budget, policy=policy)
        c = compare_greedy(whole, trace_run(llm, prompts, params), 32)
        rows.append(
            [
                name,
                f"{policy}, budget {budget}",
                len(prompts),
                c["same"],
                c["ties"],
                c["mismatches"],
                c["worst_rel_err"],
            ]
        )
    return rows


# -- timing --------------------------------------------------------------------------------
def timed_launch(llm: LLM) -> list[float]:
    """Wrap the runner so every launch() records its host time; returns the list it fills."""
    times: list[float] = []
    launch = llm.runner.launch

    def timed(*args: Any) -> Any:
        t = time.perf_counter()
        out = launch(*args)
        times.append(time.perf_counter() - t)
        return out

    llm.runner.launch = timed  # type: ignore[method-assign]
    return times


def drive(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams,
    step: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Submit all prompts, step to completion; wall time and phase of every step."""
    step = step or llm.step
    for p in prompts:
        llm.submit(p, params)
    steps: list[tuple[str, int, float]] = []
    t_start = time.perf_counter()
    while llm.has_work():
        t = time.perf_counter()
        rec = step()
        dt = time.perf_counter() - t
        if rec is not None:
            steps.append((rec.phase, len(rec.items), dt))
    return {"steps": steps, "total_s": time.perf_counter() - t_start}


def decode_times(run: dict[str, Any], batch: int) -> list[float]:
    return [dt for phase, n, dt in run["steps"] if phase == "decode" and n == batch]


def replay_ms(llm: LLM, batch: int, reps: int = 50) -> float:
    """GPU time of one replay of the graph that served `batch` rows, as last planned."""
    graphs = llm.runner.graphs
    assert graphs is not None
    g = next(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[g]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def rand_ids(n: int, rng: random.Random, vocab: int = 49152) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


BACKEND_HEADERS = ["model", "step kind", "steps compared", "worst relative error of logits"]
CHUNK_HEADERS = [
    "model",
    "chunked run",
    "prompts",
    "same tokens",
    "diverged at a near-tie",
    "diverged (clear winner)",
    "worst logits rel. error before divergence",
]
LOGITS_HEADERS = [
    "model",
    "step",
    "FlashInfer + graphs vs HF fp32",
    "FlashInfer + graphs vs HF bf16",
    "torch attention vs HF fp32",
    "FlashInfer + graphs, float32 residual, vs HF fp32",
    "batch-invariant, float32 residual, vs HF fp32",
    "HF bf16 vs HF fp32 (yardstick)",
]


def wide_dir(r: Report) -> Path:
    if "wide_dir" not in r.data:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="wide-qwen3-"))
        make_wide_model(path, resolve("smollm2", progress=False).path, num_layers=4)
        r.data["wide_dir"] = str(path)
    return Path(r.data["wide_dir"])


def bench_engine(r: Report) -> LLM:
    if r.bench_llm is None:
        r.bench_llm = qwen_engine(
            max_running_req=256,
            max_seq_len=8320,
            num_pages=256 * 680 // 16,
            page_size=16,
            max_extend_tokens=16384,
            cache_type="naive",
        )
    return r.bench_llm
