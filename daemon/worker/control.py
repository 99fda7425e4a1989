"""Cancellation requests: the ``<prefix>:cancel`` stream, read along with every publish.

Every daemon reads the whole stream (plain XREAD from a cursor, no group):
the requests are hints naming a job id, and only the daemon holding that job
acts. The status hash's ``cancel_requested`` is the truth checked at pickup,
so a request made before this daemon started, or for a job still queued, is
not missed: the cursor starts at the stream's end *before* the first pickup.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.client import Pipeline

from batchd.producers.keys import CANCEL_FIELD, Keys

READ_COUNT = 1000


class Cancellations:
    """Collects cancelled job ids; a publisher Piggyback (one XREAD per step)."""

    def __init__(self, keys: Keys) -> None:
        self.key = keys.cancel
        self.cursor = "0-0"
        self._requested: set[str] = set()

    def start_at_end(self, client: redis.Redis) -> None:
        last: Any = client.xrevrange(self.key, count=1)
        if last:
            self.cursor = last[0][0].decode()

    def queue(self, pipe: Pipeline) -> None:
        pipe.xread({self.key: self.cursor}, count=READ_COUNT)

    def handle(self, result: Any) -> None:
        for _stream, entries in result or []:
            for entry_id, fields in entries:
                self.cursor = entry_id.decode()
                job_id = fields.get(CANCEL_FIELD.encode())
                if job_id is not None:
                    self._requested.add(job_id.decode(errors="replace"))

    def take(self) -> set[str]:
        """Job ids asked to cancel since the last call."""
        taken, self._requested = self._requested, set()
        return taken
