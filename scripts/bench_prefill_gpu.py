"""Prefill, mixed and decode steps on CUDA through the public `LLM` API, with a per-kernel
profile of each step kind, for every variant named in one run (issue 29).

    python scripts/bench_prefill_gpu.py --model DIR --out OUT [--variants eager,piecewise]
        [--sections profile,chunks,decode,stall]

DIR holds a config.json (Qwen3-0.6B's shape) and a tokenizer; weights are random bf16
(`load_format="dummy"`). Variants: `eager` runs prefill and mixed steps eagerly, as before
issue 29 (`ModelRunner.piecewise_max_tokens = 0`); `piecewise` replays the piecewise CUDA graphs
(engine.piecewise_graph). Sections:
- profile: a 512-token chunk step (one 8,000-token prompt, budget 512) and a mixed step (64
  decodes + a 512-token chunk, policy mixed, budget 576) under torch.profiler: the step period,
  the host time of `ModelRunner.launch`, GPU busy time, kernel count and the largest kernels;
- chunks: the step period of an 8,000-token prompt at budgets 512 and 2,048, with its FLOPs
  (linear and attention) over the period against the bf16 peak;
- decode: decode-only steps at batch 1, 64 and 256 (512-token prompts) against the memory floor;
- chunked: chunked against unchunked greedy tokens on 32 prompts (exactness);
- stall: 32 chats decoding when an 8,000-token prompt arrives, both policies, budgets 128, 512
  and 2,048, with the chats' steady ITL before the prompt.
Tables go to stdout and OUT/bench_prefill.md; raw numbers to OUT/bench_prefill.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.llm  # noqa: E402
from engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from instrumentation.metrics import percentile  # noqa: E402
from instrumentation.records import StepRecord  # noqa: E402
from instrumentation.sampling import SamplingParams  # noqa: E402

PEAK_TFLOPS = 989.0  # dense bf16, the H200 datasheet (the yardstick)
LONG = 8000
DEVICE = "cuda"  # --device cpu: a smoke test of the script itself on a tiny model


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class FoldedDetokenizer(IncrementalDetokenizer):
    """Random weights sample ids past the borrowed tokenizer's vocabulary: fold them into it."""

    def push(self, token_id: int) -> str:
        return super().push(token_id % self.vocab if self.vocab else token_id)


engine.llm.IncrementalDetokenizer = FoldedDetokenizer  # type: ignore[misc]


VARIANTS = {
    # name: (piecewise graphs' max tokens, qkv epilogue warps, FlashInfer prefill split-KV,
    # FlashInfer prefill backend)
    "eager": (0, 4, True, "fa2"),  # the engine before issue 29
    "piecewise": (4096, 4, True, "fa2"),
    "piecewise-w1": (4096, 1, True, "fa2"),
    "piecewise-w1-nosplit": (4096, 1, False, "fa2"),
    "piecewise-fa3": (4096, 1, True, "fa3"),  # Hopper's kernels for prefill and mixed steps
    "default": None,  # whatever the code defaults to
}


def set_variant(name: str) -> None:
    from engine.attention.flashinfer_backend import FlashInferAttention as FI
    from engine.kernels import qkv

    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; expected one of {sorted(VARIANTS)}")
    v = VARIANTS[name] or DEFAULTS
    ModelRunner.piecewise_max_tokens, qkv.NUM_WARPS, FI.prefill_split_kv, FI.prefill_backend = v


def _defaults() -> tuple[int, int, bool, str]:
    if DEVICE != "cuda":
        return (0, 1, True, "fa2")
    from engine.attention.flashinfer_backend import FlashInferAttention as FI
    from engine.kernels import qkv

    return ModelRunner.piecewise_max_tokens, qkv.NUM_WARPS, FI.prefill_split_kv, FI.prefill_backend


def engine(model: str, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        model=model, device=DEVICE, load_format="dummy", progress=False, cache_type="naive"
    )
    return LLM(**{**args, **kw})


def free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# -- FLOPs -----------------------------------------------------------------------------------
def step_flops(llm: LLM, rec: StepRecord) -> tuple[float, float]:
    """(linear, attention) FLOPs of one step: every token through every projection, logits for
    the rows that sample, and causal attention over each request's visible context."""
    m = llm.model_config
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_heads * d, m.num_kv_heads * d
    per_token = h * (q + 2 * kv) + q * h + h * 2 * m.intermediate_size + m.intermediate_size * h
    tokens = sum(i.num_tokens for i in rec.items)
    sampling = sum(1 for i in rec.items if i.kind != "chunk")
    linear = 2.0 * (tokens * per_token * m.num_layers + sampling * h * m.vocab_size)
    ctx = 0
    for i in rec.items:
        s, e = i.start, i.end
        ctx += (e * (e + 1) - s * (s + 1)) // 2  # token p sees positions 0..p
    attention = 4.0 * ctx * q * m.num_layers
    return linear, attention


# -- profiling ---------------------------------------------------------------------------------
class LaunchTimer:
    """Host seconds spent in ModelRunner.launch, per call."""

    def __init__(self, llm: LLM) -> None:
        self.times: list[float] = []
        self.on = True
        runner = llm.runner
        inner = runner.launch

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = inner(*a, **kw)
            if self.on:
                self.times.append(time.perf_counter() - t)
            return out

        runner.launch = timed  # type: ignore[method-assign]


@dataclass
class Profile:
    steps: int
    kernels: int
    memcpy: int
    gpu_ms: float  # summed kernel time
    busy_ms: float  # union of kernel intervals
    top: list[tuple[str, int, float]]  # name, count per step, ms per step


def kernel_profile(run_steps: Any, n: int) -> Profile:
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(n)
        sync()
    kernels, memcpy = [], 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            memcpy += 1
            continue
        kernels.append((e.name, e.time_range.start, e.time_range.end))
    per: Counter[str] = Counter()
    dur: Counter[str] = Counter()
    for name, a, b in kernels:
        short = name if len(name) < 70 else name[:67] + "..."
        per[short] += 1
        dur[short] += b - a
    busy, end = 0.0, float("-inf")
    for _, a, b in sorted(kernels, key=lambda k: k[1]):
        if b > end:
            busy += b - max(a, end)
            end = b
    top = [(k, per[k] // max(n, 1), dur[k] / n / 1e3) for k, _ in dur.most_common(12)]
    return Profile(
        n,
        len(kernels) // n,
        memcpy // n,
        sum(dur.values()) / n / 1e3,
        busy / n / 1e3,
        top,
    )


def long_prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + salt) % 30000 + 100 for i in range(n)]


def run_until(llm: LLM, pred: Any, limit: int = 100000) -> None:
    for _ in range(limit):
        if pred():
            return
        llm.step()
    raise RuntimeError("condition not reached")


def chunk_and_mixed(model: str, out: dict[str, Any], variant: str, md: list[str]) -> None:
    """The two step kinds of Must show 1: period, host, GPU, kernels."""
    for kind in ("chunk512", "mixed64+512"):
        profile_kind(model, out, variant, md, kind)
        free()


def profile_kind(model: str, out: dict[str, Any], variant: str, md: list[str], kind: str) -> None:
    decoders = 64 if kind.startswith("mixed") else 0
    budget = 512 + decoders
    llm = engine(
        model, max_extend_tokens=budget, policy="mixed", max_running_req=96, max_seq_len=8192
    )
    recs: list[StepRecord] = []
    llm.add_step_hook(recs.append)
    llm.generate([long_prompt(600, 1)], SamplingParams(max_tokens=4, ignore_eos=True))
    for i in range(decoders):
        llm.submit(long_prompt(128, 10 + i), SamplingParams(max_tokens=4000, ignore_eos=True))
    run_until(llm, lambda: not llm.scheduler.waiting)
    for _ in range(5):
        llm.step()
    timer = LaunchTimer(llm)
    llm.submit(long_prompt(LONG, 3), SamplingParams(max_tokens=2, ignore_eos=True))
    first = len(recs)
    for _ in range(4):  # into the prompt's chunks
        llm.step()
    n_prof = 4
    timer.on = False
    lo = recs[-1].step
    prof = kernel_profile(lambda k: [llm.step() for _ in range(k)], n_prof)
    hi = recs[-1].step + 1  # the step in flight ran partly under the profiler too
    timer.on = True
    for _ in range(60):  # through the rest of the prompt
        llm.step()
        if recs and recs[-1].prompt_tokens == 0 and len(recs) > first + 8:
            break
    chunk_recs = [
        (a, b)
        for a, b in zip(recs, recs[1:], strict=False)
        if b.prompt_tokens == 512
        and b.num_decodes == decoders
        and b.step > recs[first].step
        and not lo <= b.step <= hi + 1
    ]
    periods = [(b.t1 - a.t1) * 1e3 for a, b in chunk_recs]
    flops = [step_flops(llm, b) for _, b in chunk_recs]
    host = timer.times
    row = dict(
        variant=variant,
        kind=kind,
        steps=len(periods),
        period_ms=statistics.median(periods) if periods else None,
        host_launch_ms=statistics.median(host) * 1e3 if host else None,
        gpu_kernel_ms=prof.gpu_ms,
        gpu_busy_ms=prof.busy_ms,
        kernels=prof.kernels,
        memcpy=prof.memcpy,
        tflops=(sum(sum(f) for f in flops) / (sum(periods) / 1e3) / 1e12 if periods else None),
        top=prof.top,
    )
    out.setdefault("profile", []).append(row)
    md.append(
        f"\n#### {variant}: {kind} (median of {row['steps']} steps)\n\n"
        f"period {_f(row['period_ms'])} ms, host launch {_f(row['host_launch_ms'])} ms, "
        f"GPU kernels {_f(prof.gpu_ms)} ms (busy {_f(prof.busy_ms)} ms), "
        f"{prof.kernels} kernels + {prof.memcpy} copies a step, "
        f"{_f(row['tflops'])} TFLOP/s\n\n| kernel | per step | ms per step |\n|---|---|---|"
    )
    md += [f"| `{n}` | {c} | {ms:.3f} |" for n, c, ms in prof.top]
    print("\n".join(md[-len(prof.top) - 2 :]), flush=True)


def chunks(model: str, out: dict[str, Any], variant: str, md: list[str]) -> None:
    for budget in (512, 2048):
        llm = engine(model, max_extend_tokens=budget, max_running_req=8, max_seq_len=8192)
        recs: list[StepRecord] = []
        llm.add_step_hook(recs.append)
        llm.generate([long_prompt(budget + 100, 1)], SamplingParams(max_tokens=4, ignore_eos=True))
        recs.clear()
        # three prompts back to back: a step may end one and start the next (both counted)
        prompts = [long_prompt(LONG, 2 + k) for k in range(3)]
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        pairs = [(a, b) for a, b in zip(recs, recs[1:], strict=False) if b.prompt_tokens == budget]
        periods = [(b.t1 - a.t1) * 1e3 for a, b in pairs]
        if not periods:
            md.append(f"| {variant} | {budget} | 0 | - |")
            continue
        lin = sum(step_flops(llm, b)[0] for _, b in pairs)
        att = sum(step_flops(llm, b)[1] for _, b in pairs)
        secs = sum(periods) / 1e3
        row = dict(
            variant=variant,
            budget=budget,
            steps=len(periods),
            period_ms=statistics.median(periods),
            mean_ms=statistics.mean(periods),
            max_ms=max(periods),
            tok_s=budget * len(periods) / secs,
            tflops=(lin + att) / secs / 1e12,
            linear_tflop=lin / 1e12,
            attention_tflop=att / 1e12,
        )
        row["of_peak"] = row["tflops"] / PEAK_TFLOPS
        out.setdefault("chunks", []).append(row)
        md.append(
            f"| {variant} | {budget} | {row['steps']} | {_f(row['period_ms'])} | "
            f"{_f(row['mean_ms'])} | {_f(row['max_ms'])} | {row['tok_s']:,.0f} | "
            f"{row['tflops']:.0f} | {100 * row['of_peak']:.1f}% |"
        )
        print(md[-1], flush=True)
        del llm
        free()


def chunked(model: str, out: dict[str, Any], variant: str, md: list[str]) -> None:
    """Chunked against unchunked prefill, greedy, the first 32 tokens of 32 prompts of 200 to
    1,200 random ids: unchunked = budget 8192 (whole prompts; steps past the piecewise graphs'
    largest bucket run eagerly), chunked through the piecewise graphs. Divergences are judged as
    the GPU tests judge them (a near-tie within 4 RMS of the two runs' logit difference)."""
    import random

    from engine.checks.greedy import trace_run

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(200, 1200))] for _ in range(32)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    kw: dict[str, Any] = dict(max_running_req=32, num_pages=65536, max_seq_len=2048)
    whole = engine(model, max_extend_tokens=8192, **kw)
    ref = trace_run(whole, prompts, params)
    del whole
    free()
    runs: dict[str, Any] = {}
    saved = ModelRunner.piecewise_max_tokens
    # the last run: budget 576 with the piecewise graphs off (the same chunks, no padding)
    for policy, budget, pieces in (
        ("mixed", 128, saved), ("prefill_first", 512, saved), ("mixed", 576, saved),
        ("mixed", 576, 0),
    ):  # fmt: skip
        ModelRunner.piecewise_max_tokens = pieces
        try:
            llm = engine(model, max_extend_tokens=budget, policy=policy, **kw)
        finally:
            ModelRunner.piecewise_max_tokens = saved
        name = f"{policy}, {budget}" + ("" if pieces else " (piecewise graphs off)")
        runs[name] = trace_run(llm, prompts, params)
        del llm
        free()
        _chunked_row(out, md, variant, name, ref, runs[name])
    # the padding alone: the same chunks with the graphs on against off
    a, b = runs["mixed, 576 (piecewise graphs off)"], runs["mixed, 576"]
    _chunked_row(out, md, variant, "mixed, 576: graphs on vs off", a, b)


def _chunked_row(out: dict[str, Any], md: list[str], variant: str, name: str, ref: Any,
                 got: Any) -> None:  # fmt: skip
    """One row of the chunked table, and each divergence's top-2 gap over the runs' noise."""
    from engine.checks.greedy import compare_greedy, tie_margin

    counts = compare_greedy(ref, got, 32)
    where = []
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        j = next(
            (i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), None
        )
        if j is not None:
            gap, noise = tie_margin(a.logits[j], b.logits[j], a.tokens[j], b.tokens[j])
            where.append(dict(prompt=k, token=j, gap=gap, noise=noise, ratio=gap / noise))
    out.setdefault("chunked", []).append(dict(variant=variant, run=name, **counts, at=where))
    md.append(
        f"| {variant} | {name} | {counts['same']} | {counts['ties']} | "
        f"{counts['mismatches']} | {counts['worst_rel_err']:.4f} | "
        + ", ".join(f"p{w['prompt']}@{w['token']}: {w['ratio']:.1f}" for w in where) + " |"
    )  # fmt: skip
    print(md[-1], flush=True)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    b.synchronize()
    bw = 2 * x.numel() * 10 / (a.elapsed_time(b) / 1e3)
    del x, y
    free()
    return bw


def decode(model: str, out: dict[str, Any], variant: str, md: list[str], bw: float) -> None:
    for batch in (1, 64, 256):
        llm = engine(model, max_extend_tokens=8192, max_running_req=batch, max_seq_len=2048)
        recs: list[StepRecord] = []
        llm.add_step_hook(recs.append)
        prompts = [long_prompt(512, i) for i in range(batch)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
        recs.clear()
        llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True))
        pairs = [
            (a, b)
            for a, b in zip(recs, recs[1:], strict=False)
            if b.phase == "decode" and a.phase == "decode" and b.num_decodes == batch
        ]
        periods = [(b.t1 - a.t1) * 1e3 for a, b in pairs]
        ctx = 512 + 64
        weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
        m = llm.model_config
        kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
        floor = (weights + batch * ctx * kv) / bw * 1e3
        med = statistics.median(periods)
        row = dict(variant=variant, batch=batch, period_ms=med, floor_ms=floor, ratio=med / floor)
        out.setdefault("decode", []).append(row)
        md.append(f"| {variant} | {batch} | {med:.3f} | {floor:.3f} | {med / floor:.2f} |")
        print(md[-1], flush=True)
        del llm
        free()


def stall(model: str, out: dict[str, Any], variant: str, md: list[str]) -> None:
    llm = engine(model, max_running_req=40, max_seq_len=8192 + 64)
    llm.generate([long_prompt(64, 0)], SamplingParams(max_tokens=2, ignore_eos=True))
    for budget in (128, 512, 2048):
        for policy in ("prefill_first", "mixed"):
            llm.set_config(max_extend_tokens=budget, policy=policy)
            times: dict[int, list[float]] = {}

            def hook(ev: Any, times: dict[int, list[float]] = times) -> None:
                if ev.__class__.__name__ == "TokenEvent" and ev.uid in times:
                    times[ev.uid].append(ev.t)

            llm.add_event_hook(hook)
            for i in range(32):
                uid = llm.submit(
                    long_prompt(128, 50 + i), SamplingParams(max_tokens=160, ignore_eos=True)
                )
                times[uid] = []
            run_until(llm, lambda t=times: min(len(v) for v in t.values()) >= 20)
            t_sub = llm.now()
            steady = [b - a for ts in times.values() for a, b in zip(ts[4:], ts[5:], strict=False)]
            long_uid = llm.submit(long_prompt(LONG, budget), SamplingParams(max_tokens=4))
            first: list[float] = []

            def tok(ev: Any, first: list[float] = first, uid: int = long_uid) -> None:
                if ev.__class__.__name__ == "TokenEvent" and ev.uid == uid and not first:
                    first.append(ev.t)

            llm.add_event_hook(tok)
            while llm.has_work():
                llm.step()
            llm.remove_event_hook(hook)
            llm.remove_event_hook(tok)
            window = [
                b - a
                for ts in times.values()
                for a, b in zip(ts, ts[1:], strict=False)
                if b > t_sub and (not first or a <= first[0] + 0.05)
            ]
            row = dict(
                variant=variant,
                policy=policy,
                budget=budget,
                ttft_ms=(first[0] - t_sub) * 1e3 if first else None,
                steady_ms=(percentile(steady, 50) or 0) * 1e3,
                p50_ms=(percentile(window, 50) or 0) * 1e3,
                p99_ms=(percentile(window, 99) or 0) * 1e3,
                max_ms=max(window) * 1e3,
            )
            row["max_over_steady"] = row["max_ms"] / row["steady_ms"]
            out.setdefault("stall", []).append(row)
            md.append(
                f"| {variant} | {policy} | {budget} | {_f(row['ttft_ms'])} | "
                f"{row['steady_ms']:.2f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | "
                f"{row['max_ms']:.2f} | {row['max_over_steady']:.2f} |"
            )
            print(md[-1], flush=True)
    del llm
    free()


def jit_warmup(fa3: bool = False) -> float:
    """Build FlashInfer's JIT modules (norm, RoPE, SiLU, attention and decode for head dims 128
    and 64, and with `fa3` Hopper's prefill for 128) in parallel threads, not one by one at
    first use; seconds taken."""
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module

    bf, i32 = torch.bfloat16, torch.int32
    specs = [gen_norm_module(), gen_rope_module(), gen_act_and_mul_module("silu")]
    for d in (128, 64):
        specs.append(gen_batch_prefill_module("fa2", bf, bf, bf, i32, d, d, 0, False, False, False))
        specs.append(gen_batch_decode_module(bf, bf, bf, i32, d, d, 0, False, False))
    if fa3:
        specs.append(
            gen_batch_prefill_module("fa3", bf, bf, bf, i32, 128, 128, 0, False, False, False)
        )
    # built already (an earlier process on this machine): ninja would still take ~a minute
    specs = [spec for spec in specs if not spec.is_compiled]
    t = time.perf_counter()
    if not specs:
        return 0.0
    with ThreadPoolExecutor(len(specs)) as ex:
        list(ex.map(lambda spec: spec.build(verbose=False), specs))
    return time.perf_counter() - t


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 100 else f"{v:.0f}"


DEFAULTS: tuple[int, int, bool, str] = (0, 1, True, "fa2")


def main() -> None:
    global DEVICE, LONG, DEFAULTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="eager,piecewise")
    ap.add_argument("--sections", default="profile,chunks,decode,stall")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--long", type=int, default=LONG, help="the long prompt's tokens")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip sections past this")
    args = ap.parse_args()
    DEVICE, LONG = args.device, args.long
    DEFAULTS = _defaults()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    variants = args.variants.split(",")
    sections = args.sections.split(",")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    out: dict[str, Any] = {"device": name, "torch": torch.__version__}
    md = [f"# bench_prefill_gpu ({' '.join(sys.argv[1:])})", "", f"device {out['device']}"]
    if DEVICE == "cuda":
        out["jit_s"] = jit_warmup(any("fa3" in v for v in args.variants.split(",")))
        print(f"FlashInfer JIT: {out['jit_s']:.0f} s", flush=True)
    bw = copy_bandwidth() if "decode" in sections and DEVICE == "cuda" else 1e11
    out["copy_bw"] = bw

    def save() -> None:
        (args.out / "bench_prefill.md").write_text("\n".join(md) + "\n")
        (args.out / "bench_prefill.json").write_text(json.dumps(out, indent=1, default=str))

    heads = {
        "chunks": "| variant | budget | steps | period ms (median) | mean | max | prefill tok/s "
        "| TFLOP/s | of 989 |\n|---|---|---|---|---|---|---|---|---|",
        "decode": f"(copy rate {bw / 1e12:.2f} TB/s)\n\n| variant | batch | period ms | floor ms "
        "| period / floor |\n|---|---|---|---|---|",
        "chunked": "| variant | chunked run | same tokens | near-tie | clear winner | worst "
        "logits error before divergence | divergences: prompt@token: gap / noise |"
        "\n|---|---|---|---|---|---|---|",
        "stall": "| variant | policy | budget | long TTFT ms | steady ITL ms | ITL p50 | p99 | max "
        "| max / steady |\n|---|---|---|---|---|---|---|---|---|",
    }
    for section in sections:
        md.append(f"\n### {section}\n")
        if section in heads:
            md.append(heads[section])
            print(md[-2] + "\n" + md[-1], flush=True)
        for variant in variants:
            if time.monotonic() - t_start > args.deadline_s:
                md.append(f"(skipped {section}/{variant}: past the deadline)")
                continue
            if DEVICE == "cuda":
                set_variant(variant)
            t = time.monotonic()
            if section == "profile":
                chunk_and_mixed(args.model, out, variant, md)
            elif section == "chunks":
                chunks(args.model, out, variant, md)
            elif section == "decode":
                decode(args.model, out, variant, md, bw)
            elif section == "chunked":
                chunked(args.model, out, variant, md)
            elif section == "stall":
                stall(args.model, out, variant, md)
            print(f"[{section}/{variant}: {time.monotonic() - t:.0f} s]", flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
