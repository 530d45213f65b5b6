"""Every test here talks to servers on 127.0.0.1 that it starts and stops itself; a
watchdog bounds each test's time, so a hung socket fails the run instead of holding it."""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator

import pytest

pytest.importorskip("httpx", reason="the remote reward needs httpx")

SECONDS_PER_TEST = 120


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    """Dump every thread's stack and end the process if a test runs past its bound."""
    faulthandler.dump_traceback_later(SECONDS_PER_TEST, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
