"""What the sections share: the report they write to, the engines they build (Qwen3-0.6B's shape
with random bf16 weights), prompts of random ids, the timing of engine steps, and the device's
own yardsticks measured in the run (copy bandwidth, bf16 matmul rate, FlashInfer's JIT).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine import LLM
from engine.detokenizer import IncrementalDetokenizer
from engine.kvcache.pool import KVPool
from instrumentation.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "assets" / "qwen3-0.6b"  # a config only: the engine draws the weights
QWEN_VOCAB = 151936
DEV = "cuda"
PROMPT_LEN, NEW_TOKENS = 512, 128  # the decode rows' requests
# the decode kernels of engine/kernels (engine.models.kernels), turned off together
UNFUSED = ("qkv", "gemv", "fold", "decode")


class Report:
    """Markdown tables on stdout and OUT/bench_gpu.md, raw numbers in OUT/bench_gpu.json, both
    rewritten after every section; and the run's deadline."""

    def __init__(self, out: Path, deadline_s: float) -> None:
        self.out, self.deadline_s = out, deadline_s
        self.t0 = time.monotonic()
        self.md: list[str] = []
        self.data: dict[str, Any] = {}
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline_s - self.elapsed()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.md.append(text)

    def table(self, title: str, headers: list[str], rows: list[list[Any]]) -> None:
        lines = [f"\n### {title}\n", "| " + " | ".join(headers) + " |"]
        lines.append("|" + "---|" * len(headers))
        lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
        self.say("\n".join(lines) + "\n")

    def save(self) -> None:
        (self.out / "bench_gpu.md").write_text("\n".join(self.md) + "\n")
        (self.out / "bench_gpu.json").write_text(json.dumps(self.data, indent=1, default=str))


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:  # NaN: not measured
            return "-"
        if v == 0 or 0.01 <= abs(v) < 1e5:
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return f"{v:.2e}"
    if isinstance(v, int) and abs(v) >= 10000:
        return f"{v:,}"
    return str(v)


class FoldedDetokenizer(IncrementalDetokenizer):
    """Random weights sample ids past the borrowed tokenizer's vocabulary: every id is folded
    into it, so each token gets text through the Rust `DecodeStream` as it would for a real
    model with its own tokenizer (detokenizing costs what it would)."""

    def push(self, token_id: int) -> str:
        return super().push(token_id % self.vocab if self.vocab else token_id)


def fold_random_ids(load_format: str) -> None:
    """Under random weights (`dummy`), the engine detokenizes through `FoldedDetokenizer`."""
    if load_format == "dummy":
        import engine.step

        engine.step.IncrementalDetokenizer = FoldedDetokenizer  # type: ignore[misc]


def flashinfer_missing() -> str | None:
    """Why FlashInfer cannot run here, or None when it imports."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install raising anything else
        return f"flashinfer does not import ({e}); pip install -e '.[gpu]'"
    return None


def environment(r: Report) -> None:
    """The device, its memory and the library versions: the first table of every run."""
    import transformers

    props = torch.cuda.get_device_properties(0)
    missing = flashinfer_missing()
    if missing is None:
        import flashinfer

        fi = flashinfer.__version__
    else:
        fi = f"not importable: {missing}"
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": fi,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    r.data["env"] = env
    r.table("Environment", ["what", "value"], [[k, v] for k, v in env.items()])


def jit_warmup(fa3: bool = False) -> dict[str, float]:
    """Build FlashInfer's JIT modules (norm, RoPE, SiLU, prefill and decode attention for head
    dims 128 and 64; with `fa3`, Hopper's prefill and the page-index conversion it runs before
    every call) in parallel threads, not one by one at first use; seconds per module. Modules
    already built are skipped. fa3's two take minutes: built inside an engine step, they look
    like a hang."""
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.rope import gen_rope_module

    bf, i32 = torch.bfloat16, torch.int32
    specs: dict[str, Any] = {
        "norm": gen_norm_module(),
        "rope": gen_rope_module(),
        "silu_and_mul": gen_act_and_mul_module("silu"),
    }
    for d in (128, 64):
        specs[f"prefill d{d}"] = gen_batch_prefill_module(
            "fa2", bf, bf, bf, i32, d, d, 0, False, False, False
        )
        specs[f"decode d{d}"] = gen_batch_decode_module(bf, bf, bf, i32, d, d, 0, False, False)
    if fa3:
        specs["prefill fa3 d128"] = gen_batch_prefill_module(
            "fa3", bf, bf, bf, i32, 128, 128, 0, False, False, False
        )
        specs["page"] = gen_page_module()
    todo = {k: v for k, v in specs.items() if not v.is_compiled}
    times: dict[str, float] = {}

    def build(item: tuple[str, Any]) -> None:
        t = time.perf_counter()
        try:
            item[1].build(verbose=False)
        except Exception as e:  # the run goes on: what is left unbuilt builds at first use
            print(f"FlashInfer JIT build of {item[0]} failed: {str(e)[-2000:]}", flush=True)
            times[item[0]] = float("nan")
            return
        times[item[0]] = time.perf_counter() - t

    t0 = time.perf_counter()
    if todo:
        with ThreadPoolExecutor(len(todo)) as ex:
            list(ex.map(build, todo.items()))
    times["all (parallel)"] = time.perf_counter() - t0
    return times


def qwen_engine(**kw: Any) -> LLM:
    """An engine of Qwen3-0.6B's shape with random bf16 weights on the GPU."""
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


def rand_ids(n: int, rng: random.Random, vocab: int = 49152) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def long_prompt(n: int, salt: int) -> list[int]:
    """A deterministic prompt of `n` ids, distinct per `salt` (no prefix-cache hit between)."""
    return [(7 * i + salt) % 30000 + 100 for i in range(n)]


def copy_bandwidth(r: Report) -> float:
    """Device-to-device copy rate in bytes/s (read + write), the denominator of every memory
    floor; measured once per run."""
    if "copy_bw" not in r.data:
        n = 2 << 30
        x = torch.empty(n, dtype=torch.uint8, device=DEV)
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            y.copy_(x)
        end.record()
        end.synchronize()
        r.data["copy_bw"] = 2 * n / (start.elapsed_time(end) / 20 / 1e3)
        del x, y
        free()
        r.table("Copy bandwidth (device to device, read + write)", ["bytes copied", "TB/s"],
                [[f"{n / 2**30:.0f} GiB", r.data["copy_bw"] / 1e12]])  # fmt: skip
    return float(r.data["copy_bw"])


def matmul_rate(r: Report) -> float:
    """Dense bf16 matmul FLOP/s of this device (an 8192-square product, median of 10), the
    denominator of the prefill steps' share of peak; measured once per run."""
    if "matmul_flops" not in r.data:
        n = 8192
        a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        r.data["matmul_flops"] = 2 * n**3 / sorted(times)[len(times) // 2]
        del a, b
        free()
        r.table("bf16 matmul rate (8192 x 8192 x 8192)", ["TFLOP/s"],
                [[r.data["matmul_flops"] / 1e12]])  # fmt: skip
    return float(r.data["matmul_flops"])


def timed_launch(llm: LLM) -> list[float]:
    """Wrap the runner so every launch() records its host time; returns the list it fills
    (`del llm.runner.launch` restores the class's method)."""
    times: list[float] = []
    launch = llm.runner.launch

    def timed(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = launch(*args, **kw)
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
    """Submit all prompts, step to completion; wall time and (phase, rows, s) of every step."""
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
