"""Shared fixtures: tiny random Llama and Qwen3 model directories, and the bundled SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import make_tiny


def pytest_configure(config: pytest.Config) -> None:
    # One torch thread in the test process, as the servers the tests start have (see
    # tests/server/test_server_support.py). The suite's models are tiny, so a second thread buys
    # little, and on a busy 2-core machine OpenMP workers spinning for a descheduled peer made
    # every step ~10x slower (measured: the tiny-model exactness test, 26.7 s against 4.4 s).
    torch.set_num_threads(1)


# The browser tests in two queues, by file (about equal time each). Each drives an engine, a
# Streamlit server and chromium, and spends most of its time waiting on the page (a CI run used
# 1.45 of its 2 cores), so one queue per worker keeps both busy; all in one queue made the
# browser tests the suite's long pole (350-460 s of a 570 s run).
BROWSER_QUEUES = {
    "test_browser_live.py": "browser-a",
    "test_browser_first_minute.py": "browser-a",
    "test_browser_watch.py": "browser-a",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # With `-n 2` (pytest-xdist, `--dist loadgroup`), each queue runs one test at a time on one
    # worker.
    for item in items:
        if item.get_closest_marker("browser"):
            queue = BROWSER_QUEUES.get(item.path.name, "browser-b")
            item.add_marker(pytest.mark.xdist_group(queue))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled model, converted once into the stepscope cache."""
    from engine.models.loader import resolve

    return resolve("smollm2", progress=False).path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), smollm2_dir)
