"""Progress on stderr while the benchmark runs: which system, which workload, how far."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Prints one line per phase and throttled ``done/total`` updates.

    Updates go at most every ``interval_s`` seconds (and always on the last
    request), so a fast tiny run and a 20-minute full run both stay readable.
    """

    def __init__(
        self, *, stream: TextIO | None = None, interval_s: float = 2.0, enabled: bool = True
    ) -> None:
        self._stream = stream or sys.stderr
        self._interval = interval_s
        self._enabled = enabled
        self._label = ""
        self._last = 0.0
        self._started = time.perf_counter()

    def phase(self, label: str) -> None:
        """Announce a new phase, e.g. ``mixed / batchd``."""
        self._label = label
        self._last = time.perf_counter()
        self.say(f"{label} ...")

    def update(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < self._interval:
            return
        self._last = now
        self.say(f"{self._label}: {done}/{total} requests done")

    def say(self, message: str) -> None:
        if not self._enabled:
            return
        elapsed = time.perf_counter() - self._started
        self._stream.write(f"[bench {elapsed:6.1f}s] {message}\n")
        self._stream.flush()
