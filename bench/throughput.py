"""Is continuous batching faster than one padded batch? The engine against Hugging Face generate
on the same mixed-length prompts (16 to 512 tokens), the same output length each.

    python -m bench.throughput                          # SmolLM2 on CPU, 16 prompts
    python -m bench.throughput --model assets/qwen3-0.6b --load-format dummy --device cuda

With `--load-format dummy` both sides run random weights of the config's shape (Hugging Face
its own draw): the timings compare, the tokens do not.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from bench.common import prompt_of, table
from engine.llm import LLM
from instrumentation.errors import EngineError
from instrumentation.sampling import SamplingParams


def hf_model(llm: LLM, model: str, load_format: str) -> Any:
    """Hugging Face's model on the engine's device and dtype: the same weights from disk, or
    (dummy) its own random ones of the same shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.loader import resolve

    path = str(resolve(model, progress=False).path)
    if load_format == "dummy":
        cfg = AutoConfig.from_pretrained(path)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=llm.dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=llm.dtype)
    return hf.to(llm.device).eval()


def hf_generate(hf: Any, prompts: list[list[int]], n_out: int, device: Any) -> float:
    """Seconds for one left-padded batch of every prompt, `n_out` tokens each (after a warm-up)."""
    width = max(len(p) for p in prompts)
    pad = 0
    batch = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        batch[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    batch, mask = batch.to(device), mask.to(device)
    kw: dict[str, Any] = dict(do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        hf.generate(batch[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, **kw)
        t = time.perf_counter()
        hf.generate(batch, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out, **kw)
        return time.perf_counter() - t


def run(args: argparse.Namespace) -> None:
    llm = LLM(
        args.model,
        device=args.device,
        load_format=args.load_format,
        max_extend_tokens=args.budget,
        cache_type="naive",
        progress=False,
    )
    rng = random.Random(args.seed)
    lengths = [rng.choice([16, 32, 64, 128, 256, 512]) for _ in range(args.num_prompts)]
    prompts = [prompt_of(llm, n, i) for i, n in enumerate(lengths)]
    n_out = args.max_tokens
    params = SamplingParams(max_tokens=n_out, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up

    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    t_engine = time.perf_counter() - t
    assert all(len(o["token_ids"]) == n_out for o in outs)
    t_hf = hf_generate(hf_model(llm, args.model, args.load_format), prompts, n_out, llm.device)

    total = n_out * len(prompts)
    print(
        f"\n{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens (sum {sum(lengths)}), "
        f"{n_out} output tokens each; model {llm.info.model} ({args.load_format}), "
        f"{llm.info.device}, {llm.info.dtype}, torch threads {torch.get_num_threads()}, "
        f"engine budget {args.budget}\n"
    )
    rows = [
        ["stepscope engine (continuous batching)", t_engine, total / t_engine],
        ["HF generate (one padded batch)", t_hf, total / t_hf],
    ]
    print(table(["system", "wall s", "output tok/s"], rows))
    print(f"\nengine / HF throughput ratio: {t_hf / t_engine:.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    ap.add_argument("--budget", type=int, default=512, help="the engine's max_extend_tokens")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' lengths")
    args = ap.parse_args(argv)
    try:
        run(args)
    except EngineError as e:  # a bad budget, model path, ...: say so, without a traceback
        ap.error(str(e))


if __name__ == "__main__":
    main()
