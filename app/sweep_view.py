"""A sweep folder in the page: its trade-off curve, and which run a clicked point is. Pure.

A sweep folder is what `python -m engine.bench --workload sweep --out DIR` writes
(instrumentation.sweep): one `<policy>-<budget>.jsonl` per run, and `summary.csv`. The figure is
the same one the bench writes to `tradeoff.html`; each point's customdata starts with its run
file's name, so a click (Streamlit's `on_select`) says which recording to open.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from instrumentation.sweep import SweepRow, load_rows, parse_run_name, run_files, tradeoff_figure


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


def figure(sweep: SweepFolder) -> Any:
    return tradeoff_figure(sweep.rows, title=sweep.title)


def run_of_point(point: Mapping[str, Any]) -> str | None:
    """The run file a selected point names (its customdata's first entry)."""
    custom = point.get("customdata")
    if isinstance(custom, Sequence) and not isinstance(custom, str) and custom:
        name = custom[0]
    else:
        name = custom
    return name if isinstance(name, str) and parse_run_name(name) else None


def selected_run(sweep: SweepFolder, selection: Any) -> Path | None:
    """The run file of the first selected point of a `st.plotly_chart(on_select=...)` event."""
    points = _points(selection)
    for point in points:
        name = run_of_point(point)
        if name is not None and name in sweep.runs:
            return sweep.runs[name]
    return None


def _points(selection: Any) -> list[Mapping[str, Any]]:
    if selection is None:
        return []
    sel = selection.get("selection") if isinstance(selection, Mapping) else None
    if sel is None:
        sel = getattr(selection, "selection", None)
    if sel is None:
        return []
    points = sel.get("points") if isinstance(sel, Mapping) else getattr(sel, "points", None)
    return list(points or [])
