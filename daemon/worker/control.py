"""Cancellation requests: each partition's ``cancel`` stream, read along with every publish.

Every daemon reads every partition's stream (plain XREAD from a cursor per stream, no
group): the requests are hints naming a job id, and only the daemon holding that job
acts. The status hash's ``cancel_requested`` is the truth checked at pickup,
so a request made before this daemon started, or for a job still queued, is
not missed: the cursors start at the streams' ends *before* the first pickup.
On one Redis a single XREAD reads them all; a Redis Cluster serves one slot per
command, so there each partition's stream is read by an XREAD of its own.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.client import Pipeline

from batchd.producers.connection import is_cluster
from batchd.producers.keys import CANCEL_FIELD, Keys

READ_COUNT = 1000


class Cancellations:
    """Collects cancelled job ids; a publisher Piggyback (one XREAD per step, or one per
    partition on a Cluster)."""

    def __init__(self, keys: Keys, client: redis.Redis) -> None:
        self.cursors = dict.fromkeys(keys.cancel_streams(), "0-0")
        self.split = is_cluster(client) and len(self.cursors) > 1
        self._requested: set[str] = set()

    def start_at_end(self, client: redis.Redis) -> None:
        pipe = client.pipeline(transaction=False)
        for stream in self.cursors:
            pipe.xrevrange(stream, count=1)
        for stream, last in zip(self.cursors, pipe.execute(), strict=True):
            if last:
                self.cursors[stream] = last[0][0].decode()

    def queue(self, pipe: Pipeline) -> int:
        if not self.split:
            streams: dict[Any, Any] = dict(self.cursors)
            pipe.xread(streams, count=READ_COUNT)
            return 1
        for stream, cursor in self.cursors.items():
            pipe.xread({stream: cursor}, count=READ_COUNT)
        return len(self.cursors)

    def handle(self, results: list[Any]) -> None:
        for result in results:
            if isinstance(result, Exception):
                continue  # read again from the same cursor by the next publish
            for stream, entries in result or []:
                for entry_id, fields in entries:
                    self.cursors[stream.decode()] = entry_id.decode()
                    job_id = fields.get(CANCEL_FIELD.encode())
                    if job_id is not None:
                        self._requested.add(job_id.decode(errors="replace"))

    def take(self) -> set[str]:
        """Job ids asked to cancel since the last call."""
        taken, self._requested = self._requested, set()
        return taken
