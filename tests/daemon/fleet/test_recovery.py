"""Recovery's rule for dead consumers, on a real redis-server: forgotten only when dead
(no heartbeat key), idle for a heartbeat TTL and holding nothing."""

from __future__ import annotations

import time

from daemon.fleet.recovery import Recovery
from producers.keys import CONSUMER_GROUP, Keys
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
    recovery = Recovery(client, KEYS, consumer="me", heartbeat_ttl_s=0.05)
    time.sleep(0.1)  # every consumer idle for more than the TTL

    assert recovery.forget_dead("default") == 1
    left = {c["name"].decode() for c in client.xinfo_consumers(stream, CONSUMER_GROUP)}
    assert left == {"dead-holding", "alive-empty", "me"}
