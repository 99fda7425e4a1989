"""Cancellation requests: each partition's ``cancel`` stream, read along with every publish.

Every daemon reads the streams of the partitions it holds jobs of (plain XREAD from a
cursor per stream, no group): the requests are hints naming a job id, and only the
daemon holding that job acts. The status hash's ``cancel_requested`` is the truth checked
at pickup, so a request made before this daemon started, or for a job still queued, is
not missed: the cursors start at the streams' ends *before* the first pickup.

A stream is read only while a job of its partition is held: the requests of any other
partition name no job of this daemon's. A cursor left behind meanwhile only moves
forward, so it is still older than the pickup's check of ``cancel_requested`` when a job
of that partition is held next: a request made after that check is read (after the ones
in between, which name no held job and are skipped). On one Redis a single XREAD reads
them all; a Redis Cluster serves one slot per command, so there each partition's stream
is read by an XREAD of its own, and a partition with no job held here costs its primary
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from redis.client import Pipeline

from batchd.daemon.worker.jobs import Job
from batchd.producers.connection import is_cluster
from batchd.producers.keys import CANCEL_FIELD, Keys

READ_COUNT = 1000


class Cancellations:
    """Collects cancelled job ids; a publisher Piggyback (one XREAD per step, or on a
    Cluster one per partition of the ``held`` jobs)."""

    def __init__(self, keys: Keys, client: redis.Redis, *, held: Mapping[str, Job]) -> None:
        self.keys = keys
        self.held = held
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
        streams = self._reading()
        if not streams:
            return 0
        if not self.split:
            pipe.xread(streams, count=READ_COUNT)
            return 1
        for stream, cursor in streams.items():
            pipe.xread({stream: cursor}, count=READ_COUNT)
        return len(streams)

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

    def _reading(self) -> dict[Any, Any]:
        """The cursor of each stream to read: those of the partitions of held jobs (the
        stream an entry was read from is its job's, or the job never runs)."""
        partitions = {job.delivery.partition for job in self.held.values()}
        return {
            stream: self.cursors[stream]
            for stream in map(self.keys.cancel_stream, sorted(partitions))
        }
