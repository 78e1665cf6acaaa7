"""The server tests' `xdist_group` marks, made to work (see `apply_xdist_groups`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.test_server_support import apply_xdist_groups


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    apply_xdist_groups(config, items, Path(__file__).parent)
