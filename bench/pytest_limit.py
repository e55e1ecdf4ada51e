"""A per-test time limit for pytest where pytest-timeout is not installed (bench/gpu_check.sh
takes it then): `pytest -p bench.pytest_limit --test-limit SECONDS`.

Each test's setup, call and teardown together get SECONDS of wall time; past them the test
fails there and then (SIGALRM, as pytest-timeout's `signal` method does) and the session goes
on, so its JUnit report is written as usual. A test stuck inside one C call (a kernel launch
that never returns) fails only when the call returns: the check's part limit stops that one.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--test-limit", type=float, default=0.0, metavar="SECONDS",
                     help="wall time each test may take, setup and teardown included (0: none)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    limit = item.config.getoption("test_limit")
    if not limit:
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        pytest.fail(f"over the per-test limit of {limit:g} s (--test-limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
