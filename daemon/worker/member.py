"""This daemon as a member of the consumer group of its queues."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from batchd.daemon.worker.jobs import Delivery
from batchd.producers.connection import is_cluster
from batchd.producers.keys import CONSUMER_GROUP, Keys


@dataclass(frozen=True)
class Member:
    """What each part that reads, claims or repairs queue entries for this daemon needs
    together: its connection, the key names, and its consumer name in the group."""

    redis: redis.Redis
    keys: Keys
    consumer: str

    @property
    def cluster(self) -> bool:
        """Whether Redis is a Cluster: a command, script or read reaches one slot only."""
        return is_cluster(self.redis)

    def partitions(self, queues: list[str]) -> list[tuple[str, int]]:
        """Every (queue, partition) of ``queues``, queue by queue (priority lanes first
        stay first)."""
        return [(queue, k) for queue in queues for k in range(self.keys.partitions)]

    def stream(self, delivery: Delivery) -> str:
        """The queue stream ``delivery`` was read from (its queue's partition)."""
        return self.keys.queue(delivery.queue, delivery.partition)

    def create_groups(self, queues: list[str]) -> None:
        """Create the consumer group of each queue partition (and the stream) unless it
        exists."""
        for queue, partition in self.partitions(queues):
            try:
                self.redis.xgroup_create(
                    self.keys.queue(queue, partition), CONSUMER_GROUP, id="0", mkstream=True
                )
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
