"""Dashboard fixtures: a redis-server, a real daemon on the tiny model, the dashboard in
uvicorn on a thread, and a headless Chromium whose pages fail a test on console errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_helpers import (
    CONSUMER,
    DESKTOP,
    OPERATOR_KEY,
    Dashboard,
    PageWatch,
    open_watched,
    run_dashboard,
    screenshot_dir,
)

from batchd.producers.dashboard.options import DashboardOptions
from support.browser import chromium
from support.daemon_harness import DaemonProcess, daemon_config, wait_heartbeat


def pytest_terminal_summary(terminalreporter: Any) -> None:
    shots = sorted(screenshot_dir().glob("*.png")) if screenshot_dir().exists() else []
    if shots:
        terminalreporter.write_line(f"dashboard screenshots ({len(shots)}): {screenshot_dir()}")


@pytest.fixture(scope="module")
def daemon(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    """``batchd serve`` on the tiny model (max_deliveries 1: a job delivered twice runs
    alone; make_poison adds the crashes alone that make a real dead letter), its
    heartbeat live."""
    tmp = tmp_path_factory.mktemp("daemon")
    proc = DaemonProcess(
        daemon_config(tmp, redis_url, max_deliveries=1),
        model=tiny_model,
        log_path=tmp / "d.log",
        consumer=CONSUMER,
    ).wait_serving()
    wait_heartbeat(redis_url, CONSUMER)
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def dashboard(redis_url: str, daemon: DaemonProcess) -> Iterator[Dashboard]:
    options = DashboardOptions(operator_keys=(OPERATOR_KEY,), refresh_s=0.25, discovery_s=1.0)
    with run_dashboard(redis_url, options) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[..., PageWatch]]:
    """Opens pages (a fresh browser context each); fails the test if any of them logged
    a console error or raised."""
    opened: list[PageWatch] = []

    def make(*, viewport: dict[str, int] = DESKTOP) -> PageWatch:
        watch = open_watched(browser, viewport=viewport)
        opened.append(watch)
        return watch

    yield make
    errors = [error for watch in opened for error in watch.errors]
    for watch in opened:
        watch.page.context.close()
    assert not errors, errors
