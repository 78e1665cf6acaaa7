"""Benchmarks that print tables; each compares against its peer in the same run.

    python -m engine.bench                      # throughput: 16 mixed-length prompts, engine vs HF generate
    python -m engine.bench --workload stall     # chats decoding when a long prompt arrives, both policies
    python -m engine.bench --workload step --model assets/tiny-llama --load-format dummy
                                                # per-step engine overhead: decode steps at --batch

Numbers and the commands that made them are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import EngineError
from engine.llm import LLM
from engine.metrics import percentile
from engine.sampling import SamplingParams

TEXT = (
    "The harbour master kept a ledger of every boat that left at dawn and every boat that came "
    "back at dusk, and in the margins he wrote what the sea had been like that day. "
)


def _prompt_of(llm: LLM, n_tokens: int, salt: int) -> list[int]:
    """A natural-text prompt of exactly n_tokens; `salt` makes it differ from its siblings."""
    ids = llm.tokenizer.encode(f"Story {salt}. " + TEXT * (n_tokens // 20 + 2))
    return ids[:n_tokens]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


# -- throughput ------------------------------------------------------------------------------
def throughput(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(
        args.model,
        device=args.device,
        max_extend_tokens=args.budget,
        cache_type="naive",
        progress=False,
    )
    rng = random.Random(0)
    lengths = [rng.choice([16, 32, 64, 128, 256, 512]) for _ in range(args.num_prompts)]
    prompts = [_prompt_of(llm, n, i) for i, n in enumerate(lengths)]
    n_out = args.max_tokens
    params = SamplingParams(max_tokens=n_out, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up

    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    t_engine = time.perf_counter() - t
    assert all(len(o["token_ids"]) == n_out for o in outs)

    hf = (
        AutoModelForCausalLM.from_pretrained(str(llm_path(args.model)), dtype=llm.dtype)
        .to(llm.device)
        .eval()
    )
    width = max(lengths)
    pad = 0
    batch = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        batch[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    batch, mask = batch.to(llm.device), mask.to(llm.device)
    with torch.no_grad():
        hf.generate(
            batch[:1, -8:],
            attention_mask=mask[:1, -8:],
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=pad,
        )
        t = time.perf_counter()
        hf.generate(
            batch,
            attention_mask=mask,
            max_new_tokens=n_out,
            min_new_tokens=n_out,
            do_sample=False,
            pad_token_id=pad,
        )
        t_hf = time.perf_counter() - t

    total = n_out * len(prompts)
    print(
        f"\n{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens (sum {sum(lengths)}), "
        f"{n_out} output tokens each; model {llm.info.model}, {llm.info.device}, {llm.info.dtype}, "
        f"torch threads {torch.get_num_threads()}, engine budget {args.budget}\n"
    )
    rows = [
        ["stepscope engine (continuous batching)", t_engine, total / t_engine],
        ["HF generate (one padded batch)", t_hf, total / t_hf],
    ]
    print(_table(["system", "wall s", "output tok/s"], rows))
    print(f"\nengine / HF throughput ratio: {t_hf / t_engine:.2f}x")


def llm_path(model: str) -> Any:
    from engine.models.loader import resolve

    return resolve(model, progress=False).path


# -- the stall -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StallResult:
    policy: str
    budget: int
    long_ttft: float
    itl_p50: float
    itl_p99: float
    itl_max: float
    out_tok_s: float
    steps: int


def stall_run(llm: LLM, policy: str, budget: int, args: argparse.Namespace) -> StallResult:
    llm.set_config(max_extend_tokens=budget, policy=policy)
    chats = [
        llm.submit(
            f"Chat {i}: tell me about the sea and the boats.",
            SamplingParams(max_tokens=args.chat_tokens, ignore_eos=True),
        )
        for i in range(args.num_chats)
    ]
    finished: dict[int, dict[str, Any]] = {}
    token_times: dict[int, list[float]] = {u: [] for u in chats}

    def hook(ev: Any) -> None:
        if ev.__class__.__name__ == "TokenEvent" and ev.uid in token_times:
            token_times[ev.uid].append(ev.t)
        if ev.__class__.__name__ == "RequestEvent" and ev.event == "finished":
            finished[ev.uid] = ev.fields

    llm.add_event_hook(hook)
    steps = 0
    # the chats are decoding when the long prompt arrives
    while min(len(v) for v in token_times.values()) < 4:
        llm.step()
        steps += 1
    long_prompt = _prompt_of(llm, args.long_tokens, budget)
    t_start = llm.now()
    long_uid = llm.submit(long_prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    while llm.has_work():
        llm.step()
        steps += 1
    wall = llm.now() - t_start
    llm._event_hooks.remove(hook)
    itl = [b - a for ts in token_times.values() for a, b in zip(ts, ts[1:], strict=False)]
    out_tokens = sum(len(ts) for ts in token_times.values()) + 16
    return StallResult(
        policy,
        budget,
        finished[long_uid]["time_to_first_token_seconds"],
        percentile(itl, 50) or 0.0,
        percentile(itl, 99) or 0.0,
        max(itl),
        out_tokens / wall,
        steps,
    )


def stall(args: argparse.Namespace) -> None:
    llm = LLM(
        args.model,
        device=args.device,
        cache_type="naive",  # every run computes the long prompt in full
        max_running_req=max(32, args.num_chats + 1),
        progress=False,
    )
    llm.generate(["warm up"], SamplingParams(max_tokens=2, ignore_eos=True))
    results = [stall_run(llm, p, b, args) for b in args.budgets for p in ("prefill_first", "mixed")]
    llm.check_integrity()
    print(
        f"\n{args.num_chats} chats decoding ({args.chat_tokens} tokens each) when a "
        f"{args.long_tokens}-token prompt arrives; model {llm.info.model}, {llm.info.device}, "
        f"{llm.info.dtype}\n"
    )
    rows = [
        [r.policy, r.budget, r.long_ttft, r.itl_p50, r.itl_p99, r.itl_max, r.out_tok_s, r.steps]
        for r in results
    ]
    print(
        _table(
            [
                "policy",
                "budget",
                "long TTFT s",
                "chat ITL p50 s",
                "p99 s",
                "max s",
                "out tok/s",
                "steps",
            ],
            rows,
        )
    )
    print("\nchats' max ITL, prefill_first / mixed:")
    for b in args.budgets:
        pf = next(r for r in results if r.budget == b and r.policy == "prefill_first")
        mx = next(r for r in results if r.budget == b and r.policy == "mixed")
        print(
            f"  budget {b}: {pf.itl_max:.3f} s / {mx.itl_max:.3f} s = {pf.itl_max / mx.itl_max:.1f}x"
        )


# -- per-step overhead -----------------------------------------------------------------------
def step_overhead(args: argparse.Namespace) -> None:
    """Decode steps at a fixed batch; on a tiny model the step time is mostly the engine's own
    CPU work (scheduling, pages, inputs, sampling, detokenizing, records)."""
    import cProfile
    import pstats

    llm = LLM(
        args.model,
        device=args.device,
        load_format=args.load_format,
        cache_type="naive",
        max_running_req=args.batch,
        progress=False,
    )
    for i in range(args.batch):
        llm.submit([5 + i, 6, 7, 8] * 8, SamplingParams(max_tokens=400, ignore_eos=True))
    while llm.scheduler.waiting:
        llm.step()
    for _ in range(10):
        llm.step()
    n = 100
    t = time.perf_counter()
    for _ in range(n):
        llm.step()
    ms = (time.perf_counter() - t) / n * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        llm.step()
    prof.disable()
    calls = pstats.Stats(prof).total_calls / 50  # type: ignore[attr-defined]
    print(
        f"\ndecode steps at batch {args.batch}; model {llm.info.model} ({args.load_format}), {llm.info.device}\n"
    )
    print(_table(["ms / step (mean of 100)", "Python calls / step"], [[ms, f"{calls:,.0f}"]]))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", choices=["throughput", "stall", "step"], default="throughput")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", type=int, default=512, help="max_extend_tokens (throughput)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 128, 512], help="(stall)")
    ap.add_argument("--num-chats", type=int, default=8)
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64, help="(step)")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto", help="(step)")
    args = ap.parse_args()
    try:
        {"throughput": throughput, "stall": stall, "step": step_overhead}[args.workload](args)
    except EngineError as e:  # a bad budget, model path, ...: say so, without a traceback
        ap.error(str(e))


if __name__ == "__main__":
    main()
