"""Field tables: read the `name: value` segments of an engine's log line by pattern.

Each log format has one table mapping a field name to the pattern of its segment. A line's body
is cut into segments at its separators and every segment is matched against the table, so
fields may come in any order, new fields may appear, and a garbled segment costs only itself:
the segments no pattern reads are returned, to be counted and shown, never fatal.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Field:
    """One segment pattern: its single group is the value, converted by `convert`."""

    pattern: re.Pattern[str]
    convert: Callable[..., Any]  # called with the pattern's groups, in order


def field(pattern: str, convert: Callable[..., Any] = int) -> Field:
    return Field(re.compile(pattern), convert)


def flag(text: str) -> bool:
    return text == "True"


def percent(text: str) -> float:
    return float(text) / 100.0


class FieldTable:
    """A format's fields: name -> segment pattern. One combined pattern finds which field a
    segment is in a single match (its outer group closes last, so `lastgroup` names it)."""

    def __init__(self, fields: Mapping[str, Field]) -> None:
        self.fields = dict(fields)
        self._any = re.compile(
            "|".join(f"(?P<{name}>{spec.pattern.pattern})" for name, spec in self.fields.items())
        )

    def which(self, segment: str) -> str | None:
        m = self._any.fullmatch(segment)
        return m.lastgroup if m is not None else None


@dataclass(frozen=True, slots=True)
class Reading:
    values: dict[str, Any]
    unread: tuple[str, ...]  # segments no pattern matched: new upstream fields or garbled text


def read_segments(segments: list[str], table: FieldTable) -> Reading:
    values: dict[str, Any] = {}
    unread: list[str] = []
    for seg in segments:
        seg = seg.strip()
        if not seg:
            continue
        name = table.which(seg)
        if name is None:
            unread.append(seg)
            continue
        spec = table.fields[name]
        m = spec.pattern.fullmatch(seg)
        assert m is not None  # the combined pattern matched this field's own
        try:
            values[name] = spec.convert(*m.groups())
        except ValueError:
            unread.append(seg)
    return Reading(values, tuple(unread))


def split_body(body: str, separators: str | None = None) -> list[str]:
    """Cut a line's body at its separators (", " by default; a trailing one is dropped). A
    separator inside parentheses does not cut: `kv cache: 5.1% (3500/68959 blocks, 56000 tokens)`
    stays one segment."""
    pattern = re.compile(separators or r",\s+|,\s*$")
    parts: list[str] = []
    start = depth = 0
    pos = 0
    text = body.rstrip()
    while pos < len(text):
        ch = text[pos]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            m = pattern.match(text, pos)
            if m is not None and m.end() > pos:
                parts.append(text[start:pos])
                start = pos = m.end()
                continue
        pos += 1
    parts.append(text[start:])
    return parts
