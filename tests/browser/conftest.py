"""The browser tests share one chromium while they run one after another on a worker."""

from __future__ import annotations

import pytest

from tests.browser.harness import close_shared_browser


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or nextitem.get_closest_marker("browser") is None:
        close_shared_browser()
