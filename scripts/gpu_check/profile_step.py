"""profile: a torch.profiler trace of engine decode steps."""

from __future__ import annotations

import random

from instrumentation.sampling import SamplingParams
from scripts.gpu_check.common import PROMPT_LEN, bench_engine, rand_ids
from scripts.gpu_check.report import Report


def sec_profile(r: Report) -> None:
    """Where the engine thread's host time goes in decode steps at batch 64 (cProfile)."""
    import cProfile
    import io
    import pstats

    llm = bench_engine(r)
    rng = random.Random(3)
    for _ in range(64):
        llm.submit(rand_ids(PROMPT_LEN, rng), SamplingParams(max_tokens=48, ignore_eos=True))
    for _ in range(8):  # through the prefill
        llm.step()
    prof = cProfile.Profile()
    prof.enable()
    n = 0
    while llm.has_work():
        llm.step()
        n += 1
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    r.say(f"\n### Host profile of {n} steps at batch 64 (tottime)\n\n```\n{buf.getvalue()}\n```\n")
