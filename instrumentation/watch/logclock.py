"""Log timestamps as seconds since the first one a reader saw.

Engines print wall-clock times with a date, without a year (vLLM: `MM-DD HH:MM:SS`), or with no
date at all (early SGLang: `HH:MM:SS`). The protocol's times are seconds on one clock starting
near 0, so each timestamp becomes its offset from the first; a time that runs backwards by more
than half the unit the log leaves out (a day, a year) is taken as that unit rolling over.
"""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

_DAY = 86400.0
_YEAR = 365 * _DAY


class LogClock:
    def __init__(self) -> None:
        self._origin: float | None = None
        self._last: float | None = None
        self._carry = 0.0  # seconds added for each day or year the log's own stamps rolled over
        self._missing: float = 0.0  # what the origin's stamp left out: a day, a year, or nothing

    def seconds(self, stamp: datetime, missing_unit: float = 0.0) -> float:
        """`stamp`'s offset from the first stamp; `missing_unit` is _DAY or _YEAR when the log
        omits the date or the year (the stamp then carries a placeholder)."""
        raw = stamp.timestamp() + self._carry
        if self._last is not None and missing_unit and raw < self._last - missing_unit / 2:
            self._carry += missing_unit
            raw += missing_unit
        if self._origin is None:
            self._origin, self._missing = raw, missing_unit
        self._last = raw
        return raw - self._origin

    def at_epoch(self, ts: float, timezone: str | None = None) -> float | None:
        """A Unix time (an engine's `time.time()`) on this clock: the engine's wall clock read
        as its log would print it, in `timezone` (the engine's; default the local zone). None
        before the first stamp. Where the log omits the year or the date, the reading nearest
        the latest stamp is taken."""
        if self._origin is None or self._last is None:
            return None
        zone = ZoneInfo(timezone) if timezone else None
        when = datetime.fromtimestamp(ts, zone).replace(tzinfo=None)
        if self._missing == _YEAR:
            when = when.replace(year=2000, day=min(when.day, 29) if when.month == 2 else when.day)
        elif self._missing == _DAY:
            when = datetime.combine(datetime(2000, 1, 1).date(), when.time())
        raw = when.timestamp()
        if self._missing:
            raw += round((self._last - raw) / self._missing) * self._missing
        return raw - self._origin


def parse_stamp(date: str | None, time: str, frac: str | None = None) -> tuple[datetime, float]:
    """A log stamp `YYYY-MM-DD` (or None) and `HH:MM:SS[.frac]` → (datetime, missing unit)."""
    day = date if date is not None else "2000-01-01"
    stamp = datetime.fromisoformat(f"{day}T{time}")
    if frac:
        stamp = stamp.replace(microsecond=int(frac[:6].ljust(6, "0")))
    return stamp, (0.0 if date is not None else _DAY)


def parse_month_day(month_day: str, time: str, frac: str | None = None) -> tuple[datetime, float]:
    """vLLM's `MM-DD` and `HH:MM:SS[.mmm]` (no year; 2000 is a leap year, so 02-29 parses)."""
    stamp, _ = parse_stamp(f"2000-{month_day}", time, frac)
    return stamp, _YEAR
