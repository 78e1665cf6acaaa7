"""The page's stall demonstration, recorded by the engine, with the piecewise CUDA graphs off
(before issue 29) and on (after), and what a step cost against the tokens in it (issue 29,
Must show 4).

    python scripts/stall_recording.py --out OUT [--model assets/qwen3-0.6b
        --engine-args "--load-format dummy --http-port none"] [--variants before,after]

For each variant the engine is started the way the page autostarts one (app.launcher's
`engine_argv`: `python -m engine.server --device auto`, so CUDA where there is a GPU), with
`--trace OUT/stall-VARIANT.jsonl`: the engine itself records every message it publishes. `before`
runs the same server with `ModelRunner.piecewise_max_tokens = 0` (prefill and mixed steps
eager). A protocol client (app.client) then plays the page's "Long prompt vs. chatting
requests" preset (app.workloads) under each policy in turn at the page's default budget. Open a
recording in the page with `streamlit run app/main.py -- --trace OUT/stall-after.jsonl`.

The table (stdout and OUT/stall_recording.md) gives each step kind's period (the gap between
consecutive steps' completion times) against its tokens: decode-only steps, and steps with a
prompt chunk, whose period less a decode step's, per chunk token, is what a chunk costs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app import controls, workloads  # noqa: E402
from app.client import EngineLink  # noqa: E402
from app.launcher import EngineProcess, engine_argv  # noqa: E402
from engine.checks.browser import free_port  # noqa: E402
from instrumentation.protocol import ENDED_STATES  # noqa: E402
from instrumentation.trace import read_jsonl  # noqa: E402

# `before`: the same server module with the piecewise graphs off, as `-m engine.server` runs it
EAGER = (
    "import runpy; from engine.runner import ModelRunner; ModelRunner.piecewise_max_tokens = 0; "
    "runpy.run_module('engine.server', run_name='__main__', alter_sys=True)"
)


def server_argv(variant: str, model: str, extra: list[str], trace: Path) -> list[str]:
    argv = engine_argv(free_port(), model, (*extra, "--trace", str(trace)))
    if variant == "before":
        assert argv[1:3] == ["-m", "engine.server"]
        argv[1:3] = ["-c", EAGER]
    elif variant != "after":
        raise SystemExit(f"unknown variant {variant!r}: before or after")
    return argv


def play(link: EngineLink, policy: str, budget: int, wait_s: float) -> list[str]:
    """The stall preset under `policy`, to the end of every request it sent; its errors."""
    ok, text = controls.describe_reply(link.request(controls.set_config(budget, policy)))
    if not ok:
        return [text]
    run = workloads.PresetRun(workloads.PRESETS_BY_KEY["stall"]).start(link)
    deadline = time.monotonic() + wait_s
    while not run.finished and time.monotonic() < deadline:
        time.sleep(0.2)
    while time.monotonic() < deadline:
        recs = [r for r in link.store.snapshot(last_steps=0).requests if r["uid"] in run.uids]
        if run.finished and recs and all(r["state"] in ENDED_STATES for r in recs):
            break
        time.sleep(0.2)
    return run.errors + ([] if time.monotonic() < deadline else ["timed out"])


def record(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    trace = args.out / f"stall-{variant}.jsonl"
    argv = server_argv(variant, args.model, shlex.split(args.engine_args), trace)
    proc = EngineProcess(argv, cwd=ROOT).start()
    t0 = time.monotonic()
    while proc.state == "starting" and time.monotonic() - t0 < args.start_timeout:
        time.sleep(0.5)
    if proc.state != "ready":
        proc.stop()
        raise SystemExit(f"{variant}: the engine did not come up:\n" + "\n".join(proc.tail(30)))
    started = time.monotonic() - t0
    link = EngineLink(proc.ready_url or "").start()
    try:
        while link.status().state != "connected" and time.monotonic() - t0 < args.start_timeout:
            time.sleep(0.2)
        engine = link.store.snapshot().engine or {}
        errors = []
        for policy in args.policies.split(","):
            errors += play(link, policy, args.budget, args.wait)
    finally:
        link.close()
        proc.stop()
    print(f"{variant}: engine up in {started:.0f} s on {engine.get('device')}; errors {errors}")
    return dict(variant=variant, trace=str(trace), started_s=started, engine=engine,
                errors=errors, rows=step_costs(trace))  # fmt: skip


def step_costs(trace: Path) -> list[dict[str, Any]]:
    """Per policy and step kind: steps, tokens per step and the median period."""
    steps = [m for m in read_jsonl(trace) if m.get("type") == "step"]
    groups: dict[tuple[str, str, int], list[float]] = {}
    for a, b in zip(steps, steps[1:], strict=False):
        if b["policy"] != a["policy"]:
            continue
        chunk = sum(i["end"] - i["start"] for i in b["items"] if i["kind"] != "decode")
        decodes = sum(1 for i in b["items"] if i["kind"] == "decode")
        kind = "decode only" if not chunk else ("chunk + decodes" if decodes else "chunk")
        key = (b["policy"], kind, chunk if chunk else decodes)
        groups.setdefault(key, []).append((b["t1"] - a["t1"]) * 1e3)
    rows = []
    for (policy, kind, size), periods in sorted(groups.items()):
        rows.append(dict(policy=policy, kind=kind, size=size, steps=len(periods),
                         period_ms=statistics.median(periods)))  # fmt: skip
    return rows


def table(results: list[dict[str, Any]]) -> list[str]:
    md = [
        "| variant | policy | step | prompt tokens (or decodes) | steps | median period ms |",
        "|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            md.append(
                f"| {res['variant']} | {r['policy']} | {r['kind']} | {r['size']} | "
                f"{r['steps']} | {r['period_ms']:.2f} |"
            )
    return md


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="assets/qwen3-0.6b")
    p.add_argument("--engine-args", default="--load-format dummy --http-port none")
    p.add_argument("--variants", default="before,after")
    p.add_argument("--policies", default="prefill_first,mixed")
    p.add_argument("--budget", type=int, default=256, help="the page's default budget")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--wait", type=float, default=120.0, help="seconds per preset run at most")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [record(v, args) for v in args.variants.split(",")]
    md = table(results)
    print("\n".join(md))
    (args.out / "stall_recording.md").write_text("\n".join(md) + "\n")
    (args.out / "stall_recording.json").write_text(json.dumps(results, indent=1))
    return 0 if all(not r["errors"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
