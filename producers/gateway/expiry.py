"""Expired Batch API files leave the disk, so the store does not grow forever.

A file's record expires by itself (a Redis TTL at its ``expires_at``); its bytes are
listed by name in ``<prefix>:gateway:expiring`` (a sorted set by expiry time) and
removed by :meth:`Sweeper.sweep`, which the gateway runs every ``every_s`` while it
serves. A batch's record and stop key carry their own TTL; ``GET /v1/batches`` and
``GET /v1/files`` drop from their owner's index the ids whose record is gone.
"""

from __future__ import annotations

import logging
import time

import redis

from batchd.producers.bulk_files import FilesDir
from batchd.producers.errors import UnsafePath
from batchd.producers.gateway.store import expiring
from batchd.producers.keys import Keys

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 60.0
SWEEP_CHUNK = 500


class Sweeper:
    """Removes the bytes of expired files from the files folder."""

    def __init__(
        self, conn: redis.Redis, keys: Keys, files: FilesDir, *, every_s: float = SWEEP_EVERY_S
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.files = files
        self.every_s = every_s

    def sweep(self, now: float | None = None) -> int:
        """Remove every file due by ``now`` (default: the current time); how many."""
        cutoff = time.time() if now is None else now
        removed = 0
        while True:
            due = self.conn.zrangebyscore(expiring(self.keys), "-inf", cutoff, 0, SWEEP_CHUNK)
            if not due:
                return removed
            names = [n.decode() if isinstance(n, bytes) else str(n) for n in due]
            for name in names:
                try:
                    self.files.remove(name)
                except (UnsafePath, OSError) as exc:  # not ours to remove, or gone: forget it
                    log.warning("expired file %r not removed: %s", name, exc)
            self.conn.zrem(expiring(self.keys), *names)
            removed += len(names)
