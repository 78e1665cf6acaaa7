"""The engine tests' shared SmolLM2 engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def _smollm2_engine(smollm2_dir: Path) -> Any:
    from engine import LLM

    return LLM("smollm2", page_size=4, cache_type="radix", max_running_req=8, progress=False)


@pytest.fixture
def smollm2_llm(_smollm2_engine: Any) -> Iterator[Any]:
    """One SmolLM2 engine (pages of 4, radix cache) for every test of this worker that needs the
    real model's greedy tokens: greedy output is the same under any engine setting (what
    test_engine_exact establishes), and building the engine was most of such a test's time.
    Each test gets it idle, with the budget and policy it started with."""
    start = _smollm2_engine.config_dict()
    yield _smollm2_engine
    assert not _smollm2_engine.has_work()
    _smollm2_engine.set_config(**start)
