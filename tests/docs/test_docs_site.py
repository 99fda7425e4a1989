"""The documentation site builds with no broken link or anchor (``mkdocs build
--strict``), renders in a real headless browser with no console error, and the Grafana
dashboard it ships queries only series the daemon exports.

The browser is Chromium through Playwright, pointed at the system's Chromium (Debian's
``chromium`` package, installed by tests/run.sh through config/bootstrap.sh; see
tests/support/browser.py): Playwright's own browser download needs a network this project
does not assume. Where no Chromium can start, the browser test is skipped with the
reason. Screenshots of the pages it loads are written to ``build/docs-site/screenshots/``
(the built site's folder), for a person to look at.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.browser import chromium
from support.daemon_harness import ROOT

SITE = ROOT / "build" / "docs-site"
DASHBOARD = ROOT / "docs" / "operations" / "grafana-dashboard.json"
# The pages a new reader lands on, and the longest generated one.
PAGES = {
    "home": "",
    "getting-started": "getting-started/",
    "configuration": "reference/configuration/",
}


@pytest.fixture(scope="module")
def site() -> Path:
    """The site, built strictly into build/docs-site (a warning fails the build)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(SITE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"docs built in {time.monotonic() - started:.1f} s: {SITE}")
    return SITE


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in ("index.html", "getting-started/index.html", "reference/cli/index.html"):
        assert (site / page).is_file(), page
    assert (site / "reference" / "protocol.schema.json").is_file()
    assert (site / "operations" / "grafana-dashboard.json").is_file()
    assert (site / "bench" / "results" / "index.html").is_file()
    # The measurement log links the site's pages, never the README (docs/hooks.py).
    history = (site / "bench" / "HISTORY" / "index.html").read_text()
    assert "README.md" not in history


def test_the_dashboard_queries_only_exported_series() -> None:
    from batchd.daemon.ops.prom import DaemonMetrics

    registry = DaemonMetrics(model="m", consumer="c").registry
    # Sample names of every family (a labelled counter has no sample before its first use).
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {
        metric.name + suffix
        for metric in registry.collect()
        for suffix in suffixes.get(metric.type, ("",))
    }
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bbatchd_\w+", target["expr"]))
    assert queried and queried <= exported, queried - exported
    # Every series the daemon exports has a panel.
    families = {metric.name for metric in registry.collect()}
    shown = {name for name in families if any(q.startswith(name) for q in queried)}
    assert shown == families, families - shown


@pytest.fixture(scope="module")
def served_site(site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (search and navigation need http://)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Headless Chromium (tests/support/browser.py: skipped, with the reason, if none)."""
    with chromium() as launched:
        yield launched


@pytest.mark.parametrize("name", list(PAGES))
def test_page_renders_without_console_errors(name: str, browser: object, served_site: str) -> None:
    from playwright.sync_api import Browser

    assert isinstance(browser, Browser)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on(
        "console",
        lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url} {r.failure}"))
    started = time.monotonic()
    response = page.goto(served_site + PAGES[name], wait_until="networkidle")
    assert response is not None and response.ok, response
    heading = page.locator("article h1").first.inner_text()
    assert heading.strip(), "the page has no title"
    assert page.locator("nav.md-nav--primary").count() > 0, "no navigation"
    shots = SITE / "screenshots"
    shots.mkdir(exist_ok=True)
    page.screenshot(path=str(shots / f"{name}.png"))
    print(f"{name}: {heading!r} in {time.monotonic() - started:.2f} s, {shots / name}.png")
    page.close()
    assert not problems, problems


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass
