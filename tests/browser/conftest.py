"""The browser tests share one chromium while they run one after another on a worker, and a
failure's report shows the tabs its fixtures hold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.browser.harness import OPEN_PAGE_LOGS, close_shared_browser


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or nextitem.get_closest_marker("browser") is None:
        close_shared_browser()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    # a test's exception never reaches a fixture's `with tab(...)`: say here where its page stood
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for log in OPEN_PAGE_LOGS:
            report.sections.append(("the page when the test failed", log.report()))
