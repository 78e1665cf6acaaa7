"""A sweep folder in the page: its trade-off points, and which run a clicked point is. Pure.

A sweep folder is what `python -m bench.sweep --out DIR` writes
(instrumentation.sweep): one `<policy>-<budget>.jsonl` per run, and `summary.csv`. The page draws
the trade-off in its chart component (app/live/static/sweep.js) from the folder's rows, each
point named by its run file, so a click says which recording to open (`tradeoff.html` is the
sweep's own file output, not what the page draws).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from instrumentation.sweep import SweepRow, load_rows, parse_run_name, run_file, run_files


@dataclass(frozen=True)
class SweepFolder:
    folder: Path
    rows: list[SweepRow]
    runs: dict[str, Path]  # run file name → its path

    @property
    def title(self) -> str:
        return f"Sweep {self.folder.name}: {len(self.runs)} runs"


def load(folder: str | Path) -> SweepFolder:
    """Read a sweep folder; raises ValueError when it holds no runs."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    runs = {p.name: p for p in run_files(folder)}
    if not runs:
        raise ValueError(f"{folder} has no <policy>-<budget>.jsonl run traces")
    return SweepFolder(folder, load_rows(folder), runs)


# the row figures the trade-off plot reads: x, then the y metrics it offers
POINT_FIGURES = ("ttft_p50_s", "worst_stall_s", "itl_p999_s", "itl_p99_s")


def points(sweep: SweepFolder) -> list[dict[str, Any]]:
    """One point per run for the page's trade-off plot (app/live/static/sweep.js): its run file,
    policy, budget and the summary's figures."""
    return [
        {
            "run": run_file(r.policy, r.budget),
            "policy": r.policy,
            "budget": r.budget,
            **{name: getattr(r, name) for name in POINT_FIGURES},
        }
        for r in sweep.rows
    ]


def selected_run(sweep: SweepFolder, state: Any) -> Path | None:
    """The run file a click on the plot chose: the component's `selected` state
    (`{"run": name, "n": clicks}`), if it names one of the folder's runs."""
    selected = state.get("selected") if isinstance(state, Mapping) else None
    name = selected.get("run") if isinstance(selected, Mapping) else None
    if isinstance(name, str) and parse_run_name(name) and name in sweep.runs:
        return sweep.runs[name]
    return None
