"""The server that test_openai_api and test_server's synchronous-engine runs share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.test_server_support import SHARED_FLAGS, ApiServer, stop


@pytest.fixture(scope="package")
def shared_server(tiny_llama_dir: Path) -> Iterator[ApiServer]:
    """One synchronous-engine server for both modules (one xdist group, so one worker starts
    it once): their tests need the same flags, and each uses fresh prompts, checks deltas of
    the counters and leaves the engine idle, so neither sees the other's requests."""
    srv = ApiServer(tiny_llama_dir, *SHARED_FLAGS, "--no-overlap")
    srv.overlap = False  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        stop(srv)
