"""Intake: reading new queue entries, never more than the engine can admit soon.

While the engine has work, the read rides along in each step's publish
pipeline (a publisher Piggyback), so a busy daemon spends no extra round trip
per step on intake: what it returns is picked up before the next step. Only
an idle daemon reads on its own, blocking until a job arrives. The read comes
after the pipeline's XACKs, so entries finished in that step free their room
in the same round trip and the pending count never exceeds the limit.

Deliveries whose pickup Redis interrupted are put back and picked up first
next time: they are pending for this consumer already and no read returns
them again.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.client import Pipeline

from batchd.daemon.worker.jobs import Delivery
from batchd.producers.keys import CONSUMER_GROUP, Keys


class Intake:
    """XREADGROUP ``>`` on every queue of this daemon; a publisher Piggyback."""

    def __init__(self, keys: Keys, queues: list[str], *, consumer: str) -> None:
        self.consumer = consumer
        self.streams: dict[Any, Any] = {keys.queue(q): ">" for q in queues}
        self.stream_prefix = keys.queue_prefix
        # How many entries the next piggybacked read may take (set before each flush).
        self.count = 0
        self.failure: redis.ResponseError | None = None
        self._read: list[Delivery] = []
        # The last read took all it asked for of some queue, so more may be waiting there:
        # a finished job's ack (which makes room) should not wait for the publish interval.
        self.backlog = False

    def read(self, client: redis.Redis, *, count: int, block_ms: int | None) -> None:
        """Read on its own (an idle daemon, blocking up to ``block_ms``)."""
        reply: Any = client.xreadgroup(
            CONSUMER_GROUP, self.consumer, self.streams, count=count, block=block_ms
        )
        self._collect(reply, count)

    def queue(self, pipe: Pipeline) -> None:
        pipe.xreadgroup(CONSUMER_GROUP, self.consumer, self.streams, count=self.count)

    def handle(self, result: Any) -> None:
        if isinstance(result, redis.ResponseError):
            # Raised by the worker's next intake, where a missing group is recreated.
            self.failure = result
            return
        self._collect(result, self.count)

    def take(self) -> list[Delivery]:
        """Every delivery read and not yet picked up, put-back ones first."""
        taken, self._read = self._read, []
        return taken

    def pending(self) -> list[Delivery]:
        """Deliveries read and not yet taken (they are pending for this consumer)."""
        return list(self._read)

    def put_back(self, deliveries: list[Delivery]) -> None:
        """Deliveries whose pickup failed: picked up again before anything newer."""
        self._read[:0] = deliveries

    def raise_failure(self) -> None:
        """Raise the error the last piggybacked read got, once."""
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def _collect(self, reply: Any, count: int) -> None:
        """Note the deliveries; ``count`` is what the read asked for of each queue."""
        self.backlog = False
        for stream, entries in reply or []:
            self.backlog = self.backlog or len(entries) >= count
            queue = stream.decode().removeprefix(self.stream_prefix)
            self._read += [
                Delivery(queue, entry_id.decode(), fields) for entry_id, fields in entries
            ]
