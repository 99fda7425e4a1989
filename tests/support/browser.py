"""A real headless Chromium for browser tests, driven by Playwright.

Playwright's own browser download needs the internet; batchd's machines install
Debian's ``chromium`` instead, so the browser is launched from a binary found here:
``$BATCHD_CHROMIUM``, else the first of CANDIDATES on the PATH. A test that needs a
browser is skipped, with the reason, when Playwright is missing or no Chromium starts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_ENV = "BATCHD_CHROMIUM"
ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]


def chromium_path() -> str | None:
    """The Chromium binary to launch, or None."""
    given = os.environ.get(CHROMIUM_ENV)
    if given:
        return given if Path(given).exists() else None
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


@contextmanager
def chromium() -> Iterator[Any]:
    """A launched headless Chromium (a Playwright ``Browser``), closed on exit; skips
    the test when none can start."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        pytest.skip("browser test: Playwright is not installed (pip install playwright)")
    path = chromium_path()
    if path is None:
        pytest.skip(
            "browser test: no Chromium found (apt-get install chromium, "
            f"or set ${CHROMIUM_ENV} to a Chrome/Chromium binary)"
        )
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=path, args=ARGS)
        except Error as exc:
            pytest.skip(f"browser test: Chromium at {path} did not start: {exc}")
        try:
            yield browser
        finally:
            browser.close()
