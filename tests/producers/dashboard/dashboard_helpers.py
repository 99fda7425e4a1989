"""What the dashboard tests share: the dashboard in uvicorn on a thread, pages that
record their console errors, screenshots, and an operator login.

Screenshots go to ``$BATCHD_SCREENSHOTS`` (default ``build/dashboard-screenshots`` in
the checkout); the run's summary prints where.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from batchd.producers.dashboard.app import create_app
from batchd.producers.dashboard.options import DashboardOptions
from support.asgi import serve_in_thread
from support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[3]
OPERATOR_KEY = "test-operator-key-0123456789"
CONSUMER = "dash-daemon"
DESKTOP = {"width": 1200, "height": 800}
PHONE = {"width": 390, "height": 844}


def screenshot_dir() -> Path:
    return Path(os.environ.get("BATCHD_SCREENSHOTS") or ROOT / "build" / "dashboard-screenshots")


@dataclass
class Dashboard:
    url: str
    redis_url: str
    options: DashboardOptions


@contextmanager
def run_dashboard(redis_url: str, options: DashboardOptions) -> Iterator[Dashboard]:
    """The dashboard app in uvicorn on a thread; stopped on exit."""
    port = free_port()
    config = uvicorn.Config(
        create_app(redis_url, options), host="127.0.0.1", port=port, log_level="warning"
    )
    with serve_in_thread(config) as url:
        yield Dashboard(url, redis_url, options)


@dataclass
class PageWatch:
    """A page, and every console error or uncaught exception it raised."""

    page: Any
    errors: list[str] = field(default_factory=list)

    def shot(self, name: str) -> Path:
        """Save a screenshot of the viewport as ``<name>.png``."""
        folder = screenshot_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.png"
        self.page.screenshot(path=str(path))
        return path


def open_watched(browser: Any, *, viewport: dict[str, int]) -> PageWatch:
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(20_000)
    watch = PageWatch(context.new_page())
    watch.page.on(
        "console",
        lambda msg: watch.errors.append(f"console: {msg.text}") if msg.type == "error" else None,
    )
    watch.page.on("pageerror", lambda exc: watch.errors.append(f"page error: {exc}"))
    watch.page.on("dialog", lambda dialog: dialog.accept())
    return watch


def log_in(watch: PageWatch, url: str, key: str = OPERATOR_KEY) -> None:
    """Log the page's context in as an operator through the login form."""
    watch.page.goto(f"{url}/login")
    watch.page.fill('input[name="key"]', key)
    watch.page.click('button[type="submit"]')
    watch.page.wait_for_selector(".badge.op")
