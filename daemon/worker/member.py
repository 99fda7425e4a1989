"""This daemon as a member of the consumer group of its queues."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from batchd.producers.keys import Keys


@dataclass(frozen=True)
class Member:
    """What each part that reads, claims or repairs queue entries for this daemon needs
    together: its connection, the key names, and its consumer name in the group."""

    redis: redis.Redis
    keys: Keys
    consumer: str
