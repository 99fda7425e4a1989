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

Every partition of every queue is read (batchd.producers.keys): deliveries are taken
lane by lane, so a priority lane comes before every partition of its queue.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.client import Pipeline

from batchd.daemon.worker.jobs import Delivery
from batchd.daemon.worker.member import Member
from batchd.producers.keys import CONSUMER_GROUP

# The longest an idle daemon on a Redis Cluster blocks on one partition before it reads
# them all again: a job added to another partition waits at most this long.
CLUSTER_BLOCK_MS = 100


class Intake:
    """XREADGROUP ``>`` on every partition of every queue of this daemon; a publisher
    Piggyback.

    On one Redis (standalone, Sentinel) a single XREADGROUP reads every stream, priority
    lanes first. A Redis Cluster serves one slot per command and can block on one only:
    each partition (all its lanes share its slot) is read by a command of its own,
    pipelined without blocking, and an idle daemon then blocks on one partition at a
    time, briefly (:data:`CLUSTER_BLOCK_MS`), the next one each time. XREADGROUP's
    COUNT is per stream: each partition gives at most its share of the room (rounded up),
    so a read takes no more than it would of an unpartitioned queue.
    """

    def __init__(self, member: Member, queues: list[str]) -> None:
        self.consumer = member.consumer
        self.cluster = member.cluster
        # Every stream read, in the order deliveries are taken (lanes first, then partition).
        self.names: dict[bytes, tuple[str, int]] = {}
        self.reads: list[dict[Any, Any]] = [{} for _ in range(member.keys.partitions)]
        for queue, partition in member.partitions(queues):
            stream = member.keys.queue(queue, partition)
            self.names[stream.encode()] = (queue, partition)
            self.reads[partition][stream] = ">"
        if not self.cluster:
            self.reads = [{stream.decode(): ">" for stream in self.names}]
        self._rank = {stream: rank for rank, stream in enumerate(self.names)}
        self._partitions = member.keys.partitions
        self._turn = 0  # the partition the next blocking read waits on (Cluster)
        # How many entries the next piggybacked read may take (set before each flush).
        self.count = 0
        self.failure: redis.ResponseError | None = None
        self._read: list[Delivery] = []
        # The last read took all it asked for of some queue, so more may be waiting there:
        # a finished job's ack (which makes room) should not wait for the publish interval.
        self.backlog = False

    def read(self, client: redis.Redis, *, count: int, block_ms: int | None) -> None:
        """Read on its own (an idle daemon, blocking up to ``block_ms``)."""
        count = self._share(count)
        if len(self.reads) == 1:
            reply: Any = client.xreadgroup(
                CONSUMER_GROUP, self.consumer, self.reads[0], count=count, block=block_ms
            )
            self._collect([reply], count)
            return
        pipe = client.pipeline(transaction=False)
        for streams in self.reads:
            pipe.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=count)
        replies = pipe.execute()
        if not any(replies) and block_ms is not None:
            streams = self.reads[self._turn % len(self.reads)]
            self._turn += 1
            block = min(block_ms, CLUSTER_BLOCK_MS)
            replies = [
                client.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=count, block=block)
            ]
        self._collect(replies, count)

    def queue(self, pipe: Pipeline) -> int:
        for streams in self.reads:
            pipe.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=self._share(self.count))
        return len(self.reads)

    def handle(self, results: list[Any]) -> None:
        for result in results:
            if isinstance(result, redis.ResponseError):
                # Raised by the worker's next intake, where a missing group is recreated.
                self.failure = result
        replies = [r for r in results if not isinstance(r, Exception)]
        self._collect(replies, self._share(self.count))

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

    def _share(self, count: int) -> int:
        """What each partition's stream may give of a read of ``count``."""
        return -(-count // self._partitions)

    def _collect(self, replies: list[Any], count: int) -> None:
        """Note the deliveries, lane by lane; ``count`` is what each read asked for of
        each stream."""
        self.backlog = False
        read: list[tuple[int, Delivery]] = []
        for reply in replies:
            for stream, entries in reply or []:
                self.backlog = self.backlog or len(entries) >= count
                queue, partition = self.names[stream]
                rank = self._rank[stream]
                read += [
                    (rank, Delivery(queue, entry_id.decode(), fields, partition=partition))
                    for entry_id, fields in entries
                ]
        read.sort(key=lambda pair: pair[0])
        self._read += [delivery for _, delivery in read]
