"""How long a dashboard redraw takes: every figure built from a long trace, then serialized.

    python scripts/bench_figures.py                       # synthetic 5,000-step trace
    python scripts/bench_figures.py --trace run.jsonl     # a trace from engine.server --trace

A redraw is what a fragment rerun does per chart: build the figure from the recorded events
(app.figures) and serialize it to the JSON that `st.plotly_chart` sends (to_dict + to_json).
Prints the median of --repeat runs per figure and window, and the whole page's sum.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import plotly.graph_objects as go  # noqa: E402
import plotly.io as pio  # noqa: E402

from app import figures  # noqa: E402
from app.derive import headline  # noqa: E402
from app.state import EventStore, Snapshot  # noqa: E402


def load(trace: Path | None, steps: int) -> Snapshot:
    store = EventStore(max_steps=max(steps, 1))
    if trace is None:
        from tests.app_peer import synthetic_trace

        messages = synthetic_trace(steps)
    else:
        from instrumentation.trace import read_jsonl

        messages = list(read_jsonl(trace))
    for msg in messages:
        store.apply(msg)
    return store.snapshot()


def builders(snap: Snapshot) -> dict[str, Callable[[list[dict]], go.Figure | object]]:
    reqs = snap.requests
    return {
        "timeline (step x)": lambda s: figures.timeline_figure(s, reqs, x="step"),
        "timeline (time x)": lambda s: figures.timeline_figure(s, reqs, x="time"),
        "KV pool": lambda s: figures.kv_figure(s, page_size=snap.page_size),
        "decode progress": lambda s: figures.decode_progress_figure(s, reqs),
        "inter-token latency": lambda s: figures.itl_figure(s, reqs),
        "headline metrics": lambda s: headline(s, reqs),
    }


def measure(build: Callable[[], object], repeat: int) -> tuple[float, float, int]:
    builds, serials, size = [], [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        fig = build()
        t1 = time.perf_counter()
        if isinstance(fig, go.Figure):
            size = len(pio.to_json(fig.to_dict(), validate=False))
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        serials.append(t2 - t1)
    return statistics.median(builds), statistics.median(serials), size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, help="JSON-lines trace (engine.server --trace)")
    parser.add_argument("--steps", type=int, default=5_000, help="synthetic trace length")
    parser.add_argument("--windows", type=int, nargs="+", default=[500, 5_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    snap = load(args.trace, args.steps)
    print(f"trace: {len(snap.steps):,} steps, {len(snap.requests):,} requests")
    header = f"{'figure':<22} {'steps':>6} {'build ms':>9} {'serialize ms':>13} {'total ms':>9} {'JSON KB':>8}"
    print(header)
    print("-" * len(header))
    for window in args.windows:
        steps = snap.steps[-window:]
        page = 0.0
        for name, build in builders(snap).items():
            b, s, size = measure(lambda build=build, steps=steps: build(steps), args.repeat)
            page += b + s if "time x" not in name else 0.0  # the page draws one timeline
            print(
                f"{name:<22} {len(steps):>6} {b * 1e3:>9.1f} {s * 1e3:>13.1f} "
                f"{(b + s) * 1e3:>9.1f} {size / 1024:>8.0f}"
            )
        print(f"{'whole page (all tabs)':<22} {len(steps):>6} {'':>9} {'':>13} {page * 1e3:>9.1f}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
