"""Shared fixtures: tiny random Llama and Qwen3 model directories, and the bundled SmolLM2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models import cached_tiny

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    # One torch thread in the test process, as the servers the tests start have (see
    # tests/server/test_server_support.py). The suite's models are tiny, so a second thread buys
    # little, and on a busy 2-core machine OpenMP workers spinning for a descheduled peer made
    # every step ~10x slower (measured: the tiny-model exactness test, 26.7 s against 4.4 s).
    torch.set_num_threads(1)
    # the controller of pytest-xdist's workers, before any starts (a run in one process
    # compiles as it goes: nothing runs beside it)
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        warm_bytecode()


# What the suite's processes import: an engine server (and its API process), and a page.
WARM = (
    "import torch, transformers, safetensors, engine.llm, engine.server.core, "
    "engine.server.frontend, instrumentation.delay",
    "import streamlit.web.cli, plotly, pandas, pyarrow, app.state, app.live.feed",
)


def convert_bundled_model() -> None:
    """On a fresh machine, start converting the bundled model (about 20 CPU-s) now, to run while
    the workers start, rather than when the first test asks for a model:
    the tiny models take its tokenizer, so nearly every worker's first test waited on it, with
    a core idle. Not waited for: a test that needs it waits on the conversion's file lock."""
    from engine.models.loader import BUNDLED_NAME, cache_root

    if not (cache_root() / BUNDLED_NAME / "config.json").is_file():
        code = "from engine.models.loader import resolve; resolve('smollm2', progress=False)"
        quiet = subprocess.DEVNULL  # its progress bars would cut into pytest's output
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=quiet, stderr=quiet)


def warm_bytecode() -> None:
    """Compile what the test processes import, once, before they start (tests/__init__.py
    keeps it): on a fresh machine the workers, and the servers and pages they start, each
    compiled the same sources at once (the first minutes of a fresh run took about 70 s longer
    than a warm one). Two processes beside each other, as the machine's two cores."""
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT) for code in WARM]
    procs[0].wait()
    convert_bundled_model()  # it imports what the first compiled
    procs[1].wait()


# The browser tests in three queues, by file (about equal time each). Each drives an engine, a
# Streamlit server and chromium, and spends most of its time waiting on the page; as queues,
# not one group, they spread over both workers and between the CPU-bound tests, so that the
# browser tests are not the suite's long pole.
BROWSER_QUEUES = {
    "test_browser_live.py": "browser-a",
    "test_browser_first_minute.py": "browser-a",
    "test_browser_delays.py": "browser-a",
    "test_browser_watch.py": "browser-c",
    "test_browser_fleet.py": "browser-c",
    "test_browser_admission.py": "browser-c",
    "test_browser_replay.py": "browser-c",
}


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # With `-n 2` (pytest-xdist, `--dist loadgroup`), each queue runs one test at a time on one
    # worker.
    for item in items:
        if item.get_closest_marker("browser"):
            queue = BROWSER_QUEUES.get(item.path.name, "browser-b")
            item.add_marker(pytest.mark.xdist_group(queue))
    apply_xdist_groups(config, items)


def apply_xdist_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the tests marked `xdist_group` the `@group` node-id suffix by which `--dist
    loadgroup` sends a group to one worker. pytest-xdist 3.8 writes it to `item._nodeid`, which
    pytest 9 no longer reads (a node id is `item._id`): every group was spread over both
    workers, and each worker started its own copy of a module's server."""
    if not config.getoption("loadgroup", False):  # set on xdist workers under loadgroup
        return
    from _pytest.nodeid import NodeId

    for item in items:
        if "@" in item.nodeid:  # a pytest that still reads xdist's suffix
            continue
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}  # fmt: skip
        if names:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled model, converted once into the stepscope cache."""
    from engine.models.loader import resolve

    return resolve("smollm2", progress=False).path


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_dir: Path) -> Path:
    return cached_tiny("llama", smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(smollm2_dir: Path) -> Path:
    return cached_tiny("qwen3", smollm2_dir)
