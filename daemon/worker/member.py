"""This daemon as a member of the consumer group of its queues."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from batchd.producers.keys import CONSUMER_GROUP, Keys


@dataclass(frozen=True)
class Member:
    """What each part that reads, claims or repairs queue entries for this daemon needs
    together: its connection, the key names, and its consumer name in the group."""

    redis: redis.Redis
    keys: Keys
    consumer: str

    def create_groups(self, queues: list[str]) -> None:
        """Create the consumer group of each queue (and the stream) unless it exists."""
        for queue in queues:
            try:
                self.redis.xgroup_create(
                    self.keys.queue(queue), CONSUMER_GROUP, id="0", mkstream=True
                )
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
