"""Kernel choices measured on a device and shipped per device name in a JSON file.

A table maps a key (a weight's shape, an attention head shape) and a row class to the
configuration that timing chose, or to None where the library's kernel (cuBLAS, FlashInfer) won.
Rows are rounded up to a power of two, so the CUDA graphs' batch sizes share a few tunings. The GPU
check pins what it measures (`pin`) and writes `rows` as the file; the engine reads the file of
its device's name once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

C = TypeVar("C")


def row_class(rows: int) -> int:
    """The row count a choice is tuned at: the power of two at or above `rows`."""
    return 1 << (max(rows, 1) - 1).bit_length()


@dataclass
class TunedTable(Generic[C]):
    path: Path
    fields: tuple[str, ...]  # the key's names in the file; the row class is "rows"
    make: Callable[..., C]  # a configuration from its fields
    choices: dict[tuple[int, ...], C | None] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)

    def load(self, device: str) -> None:
        """The choices measured on a device of this name, once; pinned ones take precedence."""
        if device in self.loaded:
            return
        self.loaded.add(device)
        if not self.path.is_file():
            return
        for row in json.loads(self.path.read_text()).get(device, []):
            cfg = self.make(**row["config"]) if row.get("config") else None
            self.choices.setdefault((*(row[f] for f in self.fields), row["rows"]), cfg)

    def lookup(
        self, key: tuple[int, ...], rows: int, device: str | None = None
    ) -> tuple[bool, C | None]:
        """(whether a choice was measured for this key and row class, that choice)."""
        if device is not None:
            self.load(device)
        k = (*key, row_class(rows))
        return k in self.choices, self.choices.get(k)

    def pin(self, key: tuple[int, ...], rows: int, cfg: C | None) -> None:
        self.choices[(*key, row_class(rows))] = cfg

    def rows(self, device: str) -> dict[str, list[dict[str, Any]]]:
        """The pinned and loaded choices, in the file's layout, under this device's name."""
        out = [
            {**dict(zip(self.fields, k[:-1], strict=True)), "rows": k[-1],
             "config": asdict(cfg) if cfg is not None else None}  # type: ignore[call-overload]
            for k, cfg in sorted(self.choices.items())
        ]  # fmt: skip
        return {device: out}
