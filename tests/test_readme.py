"""The README documents every environment variable the page and the engine read."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_stepscope_variable_read_is_in_the_readme() -> None:
    pattern = re.compile(
        r"""environ(?:\.get)?\(\s*["'](STEPSCOPE_[A-Z_]+)|environ\[["'](STEPSCOPE_[A-Z_]+)"""
    )
    read: set[str] = set()
    for folder in ("app", "engine", "instrumentation"):
        for path in (ROOT / folder).rglob("*.py"):
            for m in pattern.finditer(path.read_text()):
                read.add(m.group(1) or m.group(2))
    assert {"STEPSCOPE_URL", "STEPSCOPE_ENGINE_ARGS"} <= read  # the scan finds what it should
    readme = (ROOT / "README.md").read_text()
    missing = sorted(v for v in read if f"`{v}`" not in readme)
    assert not missing, f"read by the code but not in the README: {missing}"
