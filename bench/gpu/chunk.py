"""chunk: what a long prompt's chunk step costs. The step period of an 8,000-token prompt's
512- and 2,048-token chunks with their FLOP/s against the bf16 matmul rate measured in the run,
and a 512-token chunk step under torch.profiler: period, host launch, GPU time, kernels."""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.gpu.common import Report, free, long_prompt, matmul_rate, qwen_engine
from engine import LLM
from instrumentation.records import StepRecord
from instrumentation.sampling import SamplingParams

LONG = 8000  # the long prompt's tokens


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
    ctx = sum((i.end * (i.end + 1) - i.start * (i.start + 1)) // 2 for i in rec.items)
    return linear, 4.0 * ctx * q * m.num_layers  # token p sees positions 0..p


class LaunchTimer:
    """Host seconds spent in ModelRunner.launch, per call, while `on`."""

    def __init__(self, llm: LLM) -> None:
        self.times: list[float] = []
        self.on = True
        inner = llm.runner.launch

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = inner(*a, **kw)
            if self.on:
                self.times.append(time.perf_counter() - t)
            return out

        llm.runner.launch = timed  # type: ignore[method-assign]


@dataclass
class Profile:
    steps: int
    kernels: int  # per step
    copies: int  # memcpy and memset per step
    gpu_ms: float  # summed kernel time per step
    busy_ms: float  # the union of kernel intervals per step
    top: list[tuple[str, int, float]] = field(default_factory=list)  # name, per step, ms/step


def kernel_profile(llm: LLM, n: int) -> Profile:
    """`n` steps under torch.profiler (CUDA activity): kernels, copies and GPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            llm.step()
        torch.cuda.synchronize()
    kernels, copies = [], 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            copies += 1
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
    top = [(k, per[k] // n, dur[k] / n / 1e3) for k, _ in dur.most_common(12)]
    return Profile(n, len(kernels) // n, copies // n, sum(dur.values()) / n / 1e3,
                   busy / n / 1e3, top)  # fmt: skip


def chunk_step(llm: LLM, decoders: int, chunk: int = 512) -> dict[str, Any]:
    """`decoders` requests decoding, then a LONG-token prompt arriving in `chunk`-token chunks
    (policy mixed, budget chunk + decoders): the decode-only period before it, the period of
    its chunk steps, their host launch time and FLOP/s, and one profile of 4 chunk steps."""
    recs: list[StepRecord] = []
    llm.add_step_hook(recs.append)
    llm.generate([long_prompt(600, 1)], SamplingParams(max_tokens=4, ignore_eos=True))
    for i in range(decoders):
        llm.submit(long_prompt(128, 10 + i), SamplingParams(max_tokens=4000, ignore_eos=True))
    while llm.num_waiting():
        llm.step()
    for _ in range(12):  # decode-only steps: the period the chunk steps are set against
        llm.step()
    decode_only = [(b.t1 - a.t1) * 1e3 for a, b in zip(recs[-10:], recs[-9:], strict=False)
                   if b.prompt_tokens == 0]  # fmt: skip
    timer = LaunchTimer(llm)
    llm.submit(long_prompt(LONG, 3), SamplingParams(max_tokens=2, ignore_eos=True))
    first = len(recs)
    for _ in range(4):  # into the prompt's chunks
        llm.step()
    timer.on = False
    lo = recs[-1].step
    prof = kernel_profile(llm, 4)
    hi = recs[-1].step + 1  # the step in flight ran partly under the profiler too
    timer.on = True
    for _ in range(60):  # through the rest of the prompt
        llm.step()
        if recs[-1].prompt_tokens == 0 and len(recs) > first + 8:
            break
    pairs = [(a, b) for a, b in zip(recs, recs[1:], strict=False)
             if b.prompt_tokens == chunk and b.num_decodes == decoders
             and b.step > recs[first].step and not lo <= b.step <= hi + 1]  # fmt: skip
    periods = [(b.t1 - a.t1) * 1e3 for a, b in pairs]
    flops = sum(sum(step_flops(llm, b)) for _, b in pairs)
    del llm.runner.launch
    return {
        "decoders": decoders,
        "chunk": chunk,
        "steps": len(periods),
        "decode_only_ms": statistics.median(decode_only) if decode_only else None,
        "period_ms": statistics.median(periods) if periods else None,
        "host_launch_ms": statistics.median(timer.times) * 1e3 if timer.times else None,
        "flops_per_s": flops / (sum(periods) / 1e3) if periods else None,
        "profile": prof,
    }


def profile_table(r: Report, title: str, row: dict[str, Any]) -> None:
    p: Profile = row["profile"]
    r.table(
        title,
        ["period ms", "host launch ms", "GPU kernels ms", "GPU busy ms", "kernels / step",
         "copies / step", "TFLOP/s"],
        [[row["period_ms"], row["host_launch_ms"], p.gpu_ms, p.busy_ms, p.kernels, p.copies,
          None if row["flops_per_s"] is None else row["flops_per_s"] / 1e12]],
    )  # fmt: skip
    r.table(f"{title}: the largest kernels", ["kernel", "per step", "ms per step"],
            [[f"`{n}`", c, ms] for n, c, ms in p.top])  # fmt: skip


def run(r: Report, args: argparse.Namespace) -> None:
    peak = matmul_rate(r)
    rows, raw = [], []
    for budget in (512, 2048):
        if r.left() < 60:
            r.say(f"(skipped chunk budget {budget}: past the deadline)")
            continue
        llm = qwen_engine(max_extend_tokens=budget, max_running_req=8, max_seq_len=8192,
                          cache_type="naive")  # fmt: skip
        recs: list[StepRecord] = []
        llm.add_step_hook(recs.append)
        llm.generate([long_prompt(budget + 100, 1)], SamplingParams(max_tokens=4, ignore_eos=True))
        recs.clear()
        # three prompts back to back: a step may end one and start the next (both counted)
        prompts = [long_prompt(LONG, 2 + k) for k in range(3)]
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        pairs = [(a, b) for a, b in zip(recs, recs[1:], strict=False) if b.prompt_tokens == budget]
        periods = [(b.t1 - a.t1) * 1e3 for a, b in pairs]
        if periods:
            lin = sum(step_flops(llm, b)[0] for _, b in pairs)
            att = sum(step_flops(llm, b)[1] for _, b in pairs)
            secs = sum(periods) / 1e3
            row = {"budget": budget, "steps": len(periods), "period_ms": statistics.median(periods),
                   "max_ms": max(periods), "prefill_tok_s": budget * len(periods) / secs,
                   "tflops": (lin + att) / secs / 1e12, "of_matmul_rate": (lin + att) / secs / peak,
                   "attention_share": att / (lin + att)}  # fmt: skip
            raw.append(row)
            rows.append(list(row.values()))
        del llm
        free()
    r.table(
        f"Chunk steps of {LONG:,}-token prompts (Qwen3-0.6B shape, policy prefill_first)",
        ["budget", "steps", "period ms (median)", "max ms", "prefill tok/s", "TFLOP/s",
         "of the matmul rate", "attention's share of FLOPs"],
        rows,
    )  # fmt: skip
    r.say(f"FLOPs: every token through every projection, logits for sampling rows, causal "
          f"attention over each chunk's context; the matmul rate is {peak / 1e12:.0f} TFLOP/s "
          "(measured above).")  # fmt: skip
    if r.left() > 60:
        llm = qwen_engine(max_extend_tokens=512, policy="mixed", max_running_req=96,
                          max_seq_len=8192, cache_type="naive")  # fmt: skip
        step = chunk_step(llm, 0)
        del llm
        free()
        profile_table(r, "A 512-token chunk step", step)
        raw.append({k: v for k, v in step.items() if k != "profile"} | {"top": step["profile"].top})
    r.data["chunk"] = raw
