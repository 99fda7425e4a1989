"""The overview's sections as HTML, rendered once per tick for each kind of viewer.

The page and its live stream render the same templates (``templates/sections/``), so a
section looks the same when the page loads and after any update. A tick is rendered at
most twice (read-only viewers, operators: only operators see action buttons, and
their forms carry no per-session token, which the page's script adds on submit), however
many browsers watch.
"""

from __future__ import annotations

import time

import jinja2

from batchd.producers.dashboard.fleet.history import History
from batchd.producers.dashboard.fleet.sampler import Overview

SECTIONS = ("summary", "charts", "queues", "daemons", "workers", "errors", "actions")


class OverviewSections:
    """Renders and caches the sections of the latest tick."""

    def __init__(self, env: jinja2.Environment, history: History, *, refresh_s: float) -> None:
        self.env = env
        self.history = history
        self.refresh_s = refresh_s
        self._cache: dict[tuple[int, bool, str], dict[str, str]] = {}

    def render(
        self, overview: Overview | None, version: int, *, operator: bool, root: str
    ) -> dict[str, str]:
        """Every section's HTML for this tick (from the cache when rendered already)."""
        key = (version, operator, root)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        context = {
            "o": overview,
            "history": self.history,
            "is_operator": operator,
            "root": root,
            "at": overview.fleet.at if overview else time.time(),
            "refresh_s": self.refresh_s,
        }
        sections = {
            name: self.env.get_template(f"sections/{name}.html").render(**context)
            for name in SECTIONS
        }
        self._cache = {k: v for k, v in self._cache.items() if k[0] == version}
        self._cache[key] = sections
        return sections
