"""Recovery's rule for dead consumers, on a real redis-server: forgotten only when dead
(no heartbeat key), idle for a heartbeat TTL and holding nothing."""

from __future__ import annotations

import time

import pytest
import redis

from batchd.daemon.fleet.recovery import Recovery
from batchd.daemon.worker.jobs import Delivery
from batchd.daemon.worker.member import Member
from batchd.producers.keys import CONSUMER_GROUP, Keys
from support.redis_server import RedisServer

KEYS = Keys()


def test_only_dead_idle_consumers_with_nothing_pending_are_forgotten(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    stream = KEYS.queue()
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    client.xadd(stream, {"job": "{}"})
    client.xreadgroup(CONSUMER_GROUP, "dead-holding", {stream: ">"}, count=1)
    for name in ("dead-empty", "alive-empty", "me"):
        client.xgroup_createconsumer(stream, CONSUMER_GROUP, name)
    client.set(KEYS.daemon("alive-empty"), b"{}")
    recovery = Recovery(Member(client, KEYS, "me"), heartbeat_ttl_s=0.05)
    time.sleep(0.1)  # every consumer idle for more than the TTL

    assert recovery.forget_dead("default") == 1
    left = {c["name"].decode() for c in client.xinfo_consumers(stream, CONSUMER_GROUP)}
    assert left == {"dead-holding", "alive-empty", "me"}


def test_take_back_after_lost_writes_decides_by_where_the_entry_is(
    redis_server: RedisServer,
) -> None:
    """Pending here: pick up again. Pending elsewhere or still queued: the queue has it.
    Gone: added again from memory, owning the job's id. A refused write raises (the
    worker then picks the job up from memory, as before)."""
    client = redis_server.client()
    stream = KEYS.queue()
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    fields = {b"job": b'{"id": "j", "prompt": "x"}'}
    mine, theirs, queued = (client.xadd(stream, fields).decode() for _ in range(3))
    client.xreadgroup(CONSUMER_GROUP, "me", {stream: ">"}, count=1)
    client.xreadgroup(CONSUMER_GROUP, "other", {stream: ">"}, count=1)
    recovery = Recovery(Member(client, KEYS, "me"), heartbeat_ttl_s=1.0)

    def held(entry: str) -> Delivery:
        return Delivery("default", entry, fields)

    assert recovery.take_back(held(mine), "j") is True
    assert recovery.take_back(held(theirs), "j") is False
    assert recovery.take_back(held(queued), "j") is False
    client.hset(KEYS.job("j"), mapping={"state": "running", "entry": mine})
    client.xack(stream, CONSUMER_GROUP, mine)
    client.xdel(stream, mine)
    assert client.xlen(stream) == 2
    assert recovery.take_back(held(mine), "j") is False
    [(again, again_fields)] = client.xrange(stream, "-", "+")[-1:]
    assert again_fields == fields and client.xlen(stream) == 3
    assert client.hget(KEYS.job("j"), "entry") == again
    client.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            recovery.take_back(held("1-1"), "j")
    finally:
        client.config_set("maxmemory", 0)
