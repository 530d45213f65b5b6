"""Every test here talks to servers on 127.0.0.1 that it starts and stops itself; each has
a time limit (pytest-timeout, a test dependency), so a hung socket fails that test alone
instead of holding the run. Tests that train or start processes set a larger limit."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="the remote reward needs httpx")

HERE = Path(__file__).parent
# Seconds a test here may take unless it is marked ``@pytest.mark.timeout(seconds)``: a
# few times what the slowest unmarked test takes on a busy 2-core machine.
SECONDS_PER_TEST = 60


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The default limit for this folder's tests (the hook sees every collected test)."""
    for item in items:
        if item.path.is_relative_to(HERE) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SECONDS_PER_TEST))
