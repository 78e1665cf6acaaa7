"""Does the delay name the time a long prompt really cost the chats? The counterfactual.

    python -m bench.counterfactual                      # bundled SmolLM2 on CPU
    python -m bench.counterfactual --device cuda --model assets/qwen3-0.6b --load-format dummy

The same chats run alone, then again with a long prompt that arrives once they decode (same
prompts, greedy, same lengths, the same steps until it arrives), under each policy. For each
chat, the extra latency actually measured between the two runs (its `e2e_request_latency_seconds`
with the long prompt minus alone) is compared with what its `delay.by` charged to the long
prompt's request (instrumentation.delay, from the run's message stream, as every consumer
computes it). A ratio near 1 means the delay names the lost time; the target is 0.8-1.25 under
both policies. Each pair of runs is repeated; the medians are shown.

What the delay does not charge to the long prompt, and the measured extra may still hold: the
time between its extra steps (`host`), and, once it decodes, the chats' decode steps being a
little slower with one more (and longer) request in the batch (`own`: batching is not blamed).
`--long-output 1` (the default) keeps the second out of the comparison.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

from bench.common import flat, prompt_of, table
from instrumentation.delay import delays_of
from instrumentation.fold import Fold
from instrumentation.protocol import POLICY_NAMES


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: each chat's latency, and what its delay charged to the long prompt."""

    e2e: dict[int, float]  # chat index -> e2e_request_latency_seconds
    charged: dict[int, float]  # chat index -> delay.by[the long prompt's uid]
    stall: dict[int, float]  # chat index -> max_stall_seconds (0 when none)


def run_once(llm: Any, policy: str, args: argparse.Namespace, with_long: bool) -> RunResult:
    """The chats decode; once each has `--arrive-after` tokens the long prompt arrives (or, in
    the run alone, nothing does); then every request runs to its end."""
    from engine import SamplingParams

    llm.set_config(max_extend_tokens=args.budget, policy=policy)
    messages: list[dict[str, Any]] = []
    fold = Fold(max_steps=None, max_ended=2**62, max_ended_bytes=2**62)

    def hook(event: Any) -> None:
        msg = event.to_dict()
        messages.append(msg)
        fold.apply(msg)

    # every prompt is tokenized before the clock starts: tokenizing the long one while the
    # chats decode (about 30 ms for 8,000 tokens) would stop the engine's loop, a cost no
    # server has (its API tokenizes beside the engine) and that no delay can name
    chat_ids = [prompt_of(llm, args.chat_prompt, i) for i in range(args.chats)]
    long_ids = prompt_of(llm, args.long_tokens, 1000)
    llm.add_event_hook(hook)
    try:
        chat = SamplingParams(max_tokens=args.chat_tokens, ignore_eos=True)
        chats = [llm.submit(ids, chat) for ids in chat_ids]
        while min(_tokens(fold, u) for u in chats) < args.arrive_after:
            llm.step()
        long_uid = None
        if with_long:
            params = SamplingParams(max_tokens=args.long_output, ignore_eos=True)
            long_uid = llm.submit(long_ids, params)
        while llm.has_work():
            llm.step()
    finally:
        llm.remove_event_hook(hook)
    delays = delays_of(messages)
    e2e, charged, stall = {}, {}, {}
    for i, uid in enumerate(chats):
        rec = fold.get(uid)
        assert rec is not None
        m = rec.metrics() or {}
        e2e[i] = m["e2e_request_latency_seconds"]
        stall[i] = m.get("max_stall_seconds") or 0.0
        charged[i] = 0.0 if long_uid is None else delays[uid].by.get(long_uid, 0.0)
    return RunResult(e2e, charged, stall)


def _tokens(fold: Fold, uid: int) -> int:
    rec = fold.get(uid)
    return 0 if rec is None else rec.output_len


def compare(llm: Any, policy: str, args: argparse.Namespace) -> list[list[Any]]:
    """Table rows for one policy: per chat, then all chats together."""
    pairs = [(run_once(llm, policy, args, False), run_once(llm, policy, args, True))
             for _ in range(args.repeats)]  # fmt: skip
    rows: list[list[Any]] = []
    extras_all, charged_all = [], []
    for i in range(args.chats):
        alone = statistics.median(a.e2e[i] for a, _ in pairs)
        with_long = statistics.median(w.e2e[i] for _, w in pairs)
        extra = statistics.median(w.e2e[i] - a.e2e[i] for a, w in pairs)
        charged = statistics.median(w.charged[i] for _, w in pairs)
        stall = statistics.median(w.stall[i] for _, w in pairs)
        extras_all.append(extra)
        charged_all.append(charged)
        rows.append([policy, f"chat {i}", alone, with_long, stall, extra, charged,
                     _ratio(charged, extra)])  # fmt: skip
    extra, charged = sum(extras_all), sum(charged_all)
    rows.append([policy, "all chats", "", "", "", extra, charged, _ratio(charged, extra)])
    return rows


def _ratio(charged: float, extra: float) -> str:
    return f"{charged / extra:.2f}" if extra > 0 else "n/a"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.counterfactual",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2", help="smollm2 (bundled) or a model directory")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights from a config directory (e.g. assets/qwen3-0.6b)")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--budget", type=int, default=128, help="max_extend_tokens")
    ap.add_argument("--policies", nargs="+", default=[",".join(POLICY_NAMES)])
    ap.add_argument("--chats", type=int, default=4, help="chats decoding")
    ap.add_argument("--chat-prompt", type=int, default=32, help="prompt tokens of each chat")
    ap.add_argument("--chat-tokens", type=int, default=48, help="output tokens of each chat")
    ap.add_argument("--arrive-after", type=int, default=8,
                    help="the long prompt arrives once every chat has this many tokens")  # fmt: skip
    ap.add_argument("--long-tokens", type=int, default=1024, help="the long prompt's length")
    ap.add_argument("--long-output", type=int, default=1, help="the long prompt's output tokens")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs per policy (median)")
    args = ap.parse_args(argv)
    policies = flat(args.policies, str)
    for p in policies:
        if p not in POLICY_NAMES:
            ap.error(f"--policies: {p!r} is not one of {', '.join(POLICY_NAMES)}")
    if args.arrive_after >= args.chat_tokens:
        ap.error("--arrive-after must be below --chat-tokens: the chats must still be decoding")

    import torch

    from engine import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.gpu.common import fold_random_ids  # torch: not for --help

    fold_random_ids(args.load_format)
    settings: dict[str, Any] = dict(device=args.device, load_format=args.load_format)
    if args.dtype:
        settings["dtype"] = args.dtype
    llm = LLM(
        args.model,
        cache_type="naive",  # every run computes every prompt in full: no hit from the last run
        max_running_req=max(8, args.chats + 1),
        progress=False,
        **settings,
    )
    llm.generate(["warm up"] * args.chats, SamplingParams(max_tokens=8, ignore_eos=True))
    rows = [row for p in policies for row in compare(llm, p, args)]
    llm.check_integrity()
    info = llm.info
    print(
        f"\n{args.chats} chats ({args.chat_prompt}-token prompts, {args.chat_tokens} tokens "
        f"each); a {args.long_tokens}-token prompt ({args.long_output} output) arrives once each "
        f"has {args.arrive_after}; budget {args.budget}; {info.model} on {info.device}, "
        f"{info.dtype}; median of {args.repeats}\n"
    )
    headers = ["policy", "chat", "e2e alone s", "e2e with s", "worst stall s",
               "measured extra s", "delay.by[long] s", "ratio"]  # fmt: skip
    print(table(headers, rows))
    print("\nratio = delay.by[long] / measured extra (target 0.8-1.25)")


if __name__ == "__main__":
    main()
