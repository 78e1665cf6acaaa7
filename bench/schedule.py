"""Scheduling cost per step, with a long waiting queue against a short one; and radix eviction
cost against the size of the tree. No model: the real Scheduler, KVManager, PageTable and
RadixCache, driven the way the engine drives them, with made-up tokens.

    python -m bench.schedule [--running 32] [--waiting 10,1000] [--steps 200] [--rounds 15]

`schedule` table: 32 requests decode (they never finish during the run) while N wait at the
head of the queue for pages they cannot get, so every step tries to admit the head (a radix
match, then a refusal) and schedules 32 decodes. Timed per step: `schedule()` plus what the
engine reads for the step record (`reserved_tokens()`, `num_waiting`, `num_running`). Rounds of
each queue length alternate, so drift hits both alike; the figures are medians over rounds of
the mean per step.

`evict` table: a radix tree of N unlocked leaves; time per `evict(1)` (one page), as a pool
shortage asks for.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from engine.kvcache.manager import KVManager
from engine.kvcache.radix import RadixCache
from engine.kvcache.table import PageTable
from engine.request import RequestState
from engine.scheduler.policy import POLICIES
from engine.scheduler.scheduler import Scheduler
from instrumentation.sampling import SamplingParams

PROMPT, MAX_TOKENS = 64, 4096


class Setup:
    """`running` requests decoding and `waiting` requests that cannot be admitted."""

    def __init__(self, running: int, waiting: int, seed: int) -> None:
        rng = random.Random(seed)
        per_req = PROMPT + MAX_TOKENS
        # room for exactly `running` promises plus some cache: the queue's head never fits
        num_pages = running * per_req + per_req // 2
        table = PageTable(running * 2, per_req + 8, 1)
        self.kv = KVManager(num_pages, 1, table, RadixCache(1))
        self.sched = Scheduler(self.kv)
        self.policy = POLICIES["mixed"]()
        self.rng, self.uid, self.t = rng, 0, 0.0
        stems = [[rng.randrange(3, 49152) for _ in range(48)] for _ in range(8)]
        for _ in range(64):  # finished requests leave their prompts in the radix cache
            self.add(rng.choice(stems) + self.tokens(PROMPT - 48), max_tokens=1)
        while self.sched.has_work():
            self.step()
        for _ in range(running):
            self.add(rng.choice(stems) + self.tokens(PROMPT - 48))
        while self.sched.num_waiting:  # admit and prefill them all
            self.step()
        for _ in range(waiting):  # these share prefixes with the cache: the match walks it
            self.add(rng.choice(stems) + self.tokens(PROMPT - 48))
        assert self.sched.num_running == running and self.sched.num_waiting == waiting

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 49152) for _ in range(n)]

    def add(self, ids: list[int], max_tokens: int = MAX_TOKENS) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sched.add(RequestState(self.uid, ids, params, self.t, detok=None))  # type: ignore[arg-type]
        self.uid += 1

    def step(self) -> float:
        """One step; returns the seconds spent scheduling it (and reading its counters)."""
        self.t += 1.0
        t0 = time.perf_counter()
        s = self.sched.schedule(self.policy, 512, self.t)
        self.sched.reserved_tokens(), self.sched.num_waiting, self.sched.num_running
        spent = time.perf_counter() - t0
        if s is None:
            return spent
        self.sched.advance(s.batch)
        for req in s.batch.reqs:
            if req.can_decode:
                req.append_token(self.rng.randrange(3, 49152), self.t, int(self.t))
        for req in list(self.sched.finishing):
            self.sched.retire(req)
        return spent


def bench_schedule(args: argparse.Namespace) -> list[float]:
    queues = [int(n) for n in args.waiting.split(",")]
    setups = {n: Setup(args.running, n, seed=1) for n in queues}
    for s in setups.values():  # warm up
        for _ in range(20):
            s.step()
    per_round: dict[int, list[float]] = {n: [] for n in queues}
    for _ in range(args.rounds):
        for n in queues:
            s = setups[n]
            per_round[n].append(sum(s.step() for _ in range(args.steps)) / args.steps)
    for n in queues:  # the steady state held: nothing was admitted, nothing finished
        assert setups[n].sched.num_waiting == n and setups[n].sched.num_running == args.running
        setups[n].kv.check_integrity(setups[n].sched.active_rows())
    base = statistics.median(per_round[queues[0]])
    print(f"\nschedule(): {args.running} running (decoding), policy mixed, budget 512, "
          f"{args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print("| waiting | µs per step (median of rounds) | fastest round | slowest round | ratio |")
    print("|---|---|---|---|---|")
    ratios = []
    for n in queues:
        med = statistics.median(per_round[n])
        ratios.append(med / base)
        lo, hi = min(per_round[n]) * 1e6, max(per_round[n]) * 1e6
        print(f"| {n} | {med * 1e6:.1f} | {lo:.1f} | {hi:.1f} | {med / base:.2f} |")
    return ratios


def evict_tree(leaves: int, seed: int) -> RadixCache:
    """`leaves` unlocked 4-token leaves under 64 shared stems."""
    rng = random.Random(seed)
    cache = RadixCache(1)
    stems = [[rng.randrange(3, 49152) for _ in range(16)] for _ in range(64)]
    page = 0
    for _ in range(leaves):
        ids = rng.choice(stems) + [rng.randrange(3, 49152) for _ in range(4)]
        handle, pages = cache.match(ids + [0])
        cache.lock(handle)
        fresh = len(ids) - len(pages)
        cache.donate(handle, ids, pages + list(range(page, page + fresh)))
        page += fresh
    return cache


def bench_evict(args: argparse.Namespace) -> None:
    sizes = [int(n) for n in args.tree.split(",")]
    print(f"\nevict(1): one page from a radix tree of N unlocked leaves ({args.evictions} calls)")
    print("| leaves | nodes | µs per evict(1) |")
    print("|---|---|---|")
    for n in sizes:
        cache = evict_tree(n, seed=2)
        nodes = len(cache._nodes())
        t0 = time.perf_counter()
        for _ in range(args.evictions):
            assert cache.evict(1)
        spent = (time.perf_counter() - t0) / args.evictions
        print(f"| {n} | {nodes} | {spent * 1e6:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.schedule",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--running", type=int, default=32)
    p.add_argument("--waiting", default="10,1000", help="queue lengths; the first is the base")
    p.add_argument("--steps", type=int, default=200, help="steps per round")
    p.add_argument("--rounds", type=int, default=15, help="many short rounds: load comes in bursts")
    p.add_argument("--tree", default="1000,20000", help="leaf counts for the evict table")
    p.add_argument("--evictions", type=int, default=500)
    p.add_argument("--max-ratio", type=float, default=1.5, help="fail above this ratio")
    args = p.parse_args()
    ratios = bench_schedule(args)
    bench_evict(args)
    ok = max(ratios) <= args.max_ratio
    print(
        f"\nworst ratio {max(ratios):.2f} (target <= {args.max_ratio}): {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
