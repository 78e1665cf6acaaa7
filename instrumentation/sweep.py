"""A sweep's files: each run's trace, the summary table computed from the traces, the trade-off figure.

A sweep folder holds one `<policy>-<budget>.jsonl` per run, in the server's `--trace` format (a
`hello` header, then every broadcast with its `seq`), `summary.csv` and `tradeoff.html` (plus
`tradeoff.png` when a browser or kaleido can draw it). Every number in `summary.csv` comes from
`instrumentation.fold.summarize` over its run's JSONL, so the page, the summary and `/metrics`
agree on what TTFT, ITL and a stall are. Torch-free: the page opens sweep folders too.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from instrumentation import messages
from instrumentation.fold import Summary, summarize
from instrumentation.protocol import BROADCAST_TYPES
from instrumentation.trace import TraceWriter, read_jsonl

SUMMARY = "summary.csv"
FIGURE_HTML = "tradeoff.html"
FIGURE_PNG = "tradeoff.png"
RUN_NAME = re.compile(r"^(?P<policy>[a-z_]+)-(?P<budget>\d+)\.jsonl$")
POLICY_COLORS = {"prefill_first": "#d62728", "mixed": "#1f77b4"}
CHROMIUM = Path("/usr/bin/chromium")


class RunTrace:
    """An engine event hook that writes a run as the server's `--trace` would: the `hello`
    header (engine facts, config, empty history), then every event's message, numbered with
    `seq` from 0 as the publisher numbers broadcasts."""

    def __init__(
        self, path: str | Path, engine: dict[str, Any], config: dict[str, Any], now: float
    ) -> None:
        self.writer = TraceWriter(path)
        self.seq = -1
        facts = {**engine, "instance": uuid.uuid4().hex[:12]}  # each run is its own engine record
        header = messages.hello(now, facts, dict(config), {"steps": [], "requests": []}, None)
        self.writer.write(json.dumps(header))

    def __call__(self, event: Any) -> None:
        msg = event if isinstance(event, dict) else event.to_dict()
        if msg.get("type") in BROADCAST_TYPES:
            self.seq += 1
            msg["seq"] = self.seq
        self.writer.write(json.dumps(msg))

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True, slots=True)
class SweepRow:
    """One line of `summary.csv`: the run's policy and budget, then its `fold.Summary` figures
    (the page's headline figures, under the same names)."""

    policy: str
    budget: int
    requests: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_p999_s: float | None
    worst_stall_s: float | None
    output_tok_s: float | None


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(SweepRow))
FIGURES: tuple[str, ...] = COLUMNS[2:]  # the columns that come from the Summary


def run_file(policy: str, budget: int) -> str:
    return f"{policy}-{budget}.jsonl"


def parse_run_name(name: str) -> tuple[str, int] | None:
    """`mixed-128.jsonl` → ("mixed", 128); None for any other file name."""
    m = RUN_NAME.match(name)
    return (m["policy"], int(m["budget"])) if m else None


def summary_row(policy: str, budget: int, messages_: Iterable[dict[str, Any]]) -> SweepRow:
    """The shared fold's summary of one run, as a table row."""
    return row_of(policy, budget, summarize(messages_))


def row_of(policy: str, budget: int, s: Summary) -> SweepRow:
    return SweepRow(policy, budget, **{name: getattr(s, name) for name in FIGURES})


def run_files(folder: str | Path) -> list[Path]:
    """The run traces of a sweep folder, ordered by policy then budget."""
    found = [(parse_run_name(p.name), p) for p in Path(folder).glob("*.jsonl")]
    return [p for key, p in sorted((k, p) for k, p in found if k is not None)]


def summarize_folder(folder: str | Path) -> list[SweepRow]:
    """Recompute the summary table from the folder's run traces."""
    rows = []
    for path in run_files(folder):
        policy, budget = parse_run_name(path.name)  # type: ignore[misc]
        rows.append(summary_row(policy, budget, read_jsonl(path)))
    return rows


def write_summary(path: str | Path, rows: Sequence[SweepRow]) -> None:
    """Floats are written with `repr`, which reads back to the same float."""
    with Path(path).open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for row in rows:
            w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v
                        for v in asdict(row).values()])  # fmt: skip


def read_summary(path: str | Path) -> list[SweepRow]:
    with Path(path).open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: expected the columns {', '.join(COLUMNS)}")
        return [
            SweepRow(
                policy=r["policy"],
                budget=int(r["budget"]),
                requests=int(r["requests"]),
                **{c: float(r[c]) if r[c] else None for c in FIGURES[1:]},
            )
            for r in reader
        ]


def load_rows(folder: str | Path) -> list[SweepRow]:
    """A sweep folder's table: `summary.csv` if there is one with today's columns, else
    recomputed from the traces (an older sweep's summary lacks a column)."""
    summary = Path(folder) / SUMMARY
    if summary.exists():
        try:
            return read_summary(summary)
        except ValueError:
            pass
    return summarize_folder(folder)


# ---- the trade-off figure -------------------------------------------------------------------


def tradeoff_figure(rows: Sequence[SweepRow], title: str = "") -> Any:
    """ITL p99 against TTFT p50, one line per policy through its budgets (labelled). Each
    point's customdata is `[run file, policy, budget]`, so a click can open that run."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for policy in sorted({r.policy for r in rows}):
        pts = sorted(
            (r for r in rows if r.policy == policy and r.ttft_p50_s and r.itl_p99_s),
            key=lambda r: r.budget,
        )
        fig.add_trace(
            go.Scatter(
                x=[r.ttft_p50_s for r in pts],
                y=[r.itl_p99_s for r in pts],
                mode="lines+markers+text",
                name=policy,
                text=[str(r.budget) for r in pts],
                textposition="top center",
                marker={"size": 11, "color": POLICY_COLORS.get(policy)},
                line={"color": POLICY_COLORS.get(policy)},
                customdata=[[run_file(r.policy, r.budget), r.policy, r.budget] for r in pts],
                hovertemplate=(
                    "%{customdata[1]}, budget %{customdata[2]}<br>TTFT p50 %{x:.3f} s"
                    "<br>ITL p99 %{y:.3f} s<extra></extra>"
                ),
            )
        )
    fig.update_layout(
        title=title or "Tail inter-token latency against time to first token, by token budget",
        xaxis={"title": "TTFT p50 (s)", "type": "log"},
        yaxis={"title": "ITL p99 (s)", "type": "log"},
        legend={"title": "policy"},
        template="plotly_white",
        height=520,
        margin={"l": 70, "r": 30, "t": 60, "b": 60},
    )
    return fig


def write_figure(
    folder: str | Path, rows: Sequence[SweepRow], title: str = "", png: bool = True
) -> list[Path]:
    """`tradeoff.html` (plotly.js inline: opens offline) and, when it can be drawn,
    `tradeoff.png`; returns the files written."""
    folder = Path(folder)
    fig = tradeoff_figure(rows, title)
    html = folder / FIGURE_HTML
    fig.write_html(html, include_plotlyjs=True, full_html=True)
    written = [html]
    image = folder / FIGURE_PNG
    if png and write_png(fig, image):
        written.append(image)
    return written


def write_png(fig: Any, png: Path, size: tuple[int, int] = (1000, 560)) -> bool:
    """kaleido if installed, else headless chromium's screenshot of the figure's HTML (without
    the mode bar); False if neither can draw it."""
    try:
        fig.write_image(png, width=size[0], height=size[1])
        return True
    except (ImportError, ValueError, RuntimeError):
        pass
    browser = shutil.which("chromium") or (str(CHROMIUM) if CHROMIUM.exists() else None)
    if browser is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:  # its own profile: other chromiums may run
        html = Path(tmp) / "figure.html"
        fig.write_html(html, include_plotlyjs=True, config={"displayModeBar": False})
        argv = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp}/profile", f"--screenshot={png.resolve()}",
            f"--window-size={size[0]},{size[1] + 20}", "--virtual-time-budget=5000",
            html.as_uri(),
        ]  # fmt: skip
        try:
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
    return png.exists() and png.stat().st_size > 0


def format_table(rows: Sequence[SweepRow]) -> str:
    """The summary as a Markdown table (for the bench's output and the docs)."""
    head = "| " + " | ".join(COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = []
    for row in rows:
        cells = []
        for v in asdict(row).values():
            cells.append("–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def main(argv: list[str] | None = None) -> int:
    """`python -m instrumentation.sweep DIR`: (re)write DIR's summary.csv and trade-off figure
    from its run traces (e.g. a sweep copied from a machine without a browser, or cut short)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m instrumentation.sweep", description=main.__doc__)
    ap.add_argument("folder", help="a sweep folder of <policy>-<budget>.jsonl traces")
    ap.add_argument("--title", default="", help="the figure's title")
    ap.add_argument("--no-png", dest="png", action="store_false")
    args = ap.parse_args(argv)
    rows = summarize_folder(args.folder)
    if not rows:
        print(f"error: no <policy>-<budget>.jsonl traces in {args.folder}", file=sys.stderr)
        return 1
    write_summary(Path(args.folder) / SUMMARY, rows)
    written = write_figure(args.folder, rows, args.title, png=args.png)
    print(format_table(rows))
    print("wrote " + ", ".join(str(p) for p in [Path(args.folder) / SUMMARY, *written]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
