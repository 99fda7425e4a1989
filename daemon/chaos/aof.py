"""What a power cut does to Redis with ``appendfsync everysec``: the last second of writes.

A SIGKILL alone loses nothing: Redis writes each command to the AOF before it
replies, and the kernel's page cache outlives the process. A machine that dies
loses what was not yet fsynced, up to about a second with ``everysec``.
:class:`AofTail` samples the size of the AOF's newest increment file; after a
kill, :meth:`AofTail.cut` truncates that file back to its size about a second
earlier. Redis then loads it as after a power cut: ``aof-load-truncated yes``
drops a half-written command and rolls back a MULTI that has no EXEC.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batchd.daemon.chaos.background import Background

SAMPLE_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Cut:
    """One truncation: every write acknowledged after ``since`` (monotonic) may be gone."""

    since: float
    dropped_bytes: int


class AofTail(Background):
    """Remembers, for the last few seconds, how long the newest AOF increment file was."""

    def __init__(self, directory: Path, *, window_s: float = 1.0) -> None:
        super().__init__("aof-tail", join_timeout_s=5)
        self.directory = directory
        self.window_s = window_s
        self._samples: list[tuple[float, Path, int]] = []
        self._lock = threading.Lock()

    def newest_increment(self) -> Path | None:
        """The increment file the manifest lists last (Redis 7's multi-part AOF)."""
        folder = self.directory / "appendonlydir"
        manifests = sorted(folder.glob("*.manifest"))
        if not manifests:
            return None
        newest = None
        for line in manifests[-1].read_text().splitlines():
            fields = line.split()
            if "type" in fields and fields[fields.index("type") + 1] == "i":
                newest = folder / fields[fields.index("file") + 1]
        return newest

    def work(self) -> None:
        while not self.stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def sample(self) -> None:
        try:
            path = self.newest_increment()
            size = path.stat().st_size if path is not None else None
        except OSError:  # mid-rewrite, or Redis is down: try again next tick
            return
        if path is None or size is None:
            return
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, path, size))
            horizon = now - 5 * self.window_s
            while len(self._samples) > 1 and self._samples[0][0] < horizon:
                self._samples.pop(0)

    def cut(self) -> Cut:
        """Truncate the newest increment (Redis must be dead) to its size ``window_s`` ago."""
        path = self.newest_increment()
        killed_at = time.monotonic()
        with self._lock:
            samples = [s for s in self._samples if s[1] == path]
            self._samples.clear()
        if path is None or not samples:
            return Cut(since=killed_at, dropped_bytes=0)
        older = [s for s in samples if s[0] <= killed_at - self.window_s]
        since, _, size = older[-1] if older else samples[0]
        current = path.stat().st_size
        if size >= current:
            return Cut(since=since, dropped_bytes=0)
        os.truncate(path, size)
        return Cut(since=since, dropped_bytes=current - size)
