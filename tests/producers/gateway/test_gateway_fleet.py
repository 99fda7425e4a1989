"""The gateway's view of the fleet, read from a real redis-server: only values that are
daemon heartbeats, on the gateway's queue, count; anything else under the heartbeat
prefix (hostile or foreign writes, other key types) is passed over."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from batchd.producers.gateway.fleet import Fleet
from batchd.producers.keys import Keys
from batchd.producers.schema import DaemonHeartbeat
from support.redis_server import RedisServer

KEYS = Keys()


def _beat(consumer: str, *, model: str | None, queues: list[str]) -> bytes:
    beat = DaemonHeartbeat(
        consumer=consumer,
        model=model,
        queues=queues,
        instance=f"host:1:{consumer}",
        pid=1,
        host="host",
        started_at=time.time(),
        at=time.time(),
    )
    return beat.model_dump_json().encode()


def test_only_heartbeats_on_the_queue_are_daemons(redis_server: RedisServer) -> None:
    admin = redis_server.client()
    admin.set(KEYS.daemon("a"), _beat("a", model="/models/tiny", queues=["default"]))
    admin.set(KEYS.daemon("b"), _beat("b", model=None, queues=["default", "other"]))
    admin.set(KEYS.daemon("c"), _beat("c", model="/models/big", queues=["other"]))
    admin.set(KEYS.daemon("junk"), b"\xff not json {")
    admin.set(KEYS.daemon("array"), b'["default"]')
    admin.set(KEYS.daemon("partial"), b'{"queues": ["default"], "model": "x"}')
    admin.hset(KEYS.daemon("hash"), mapping={"queues": "default"})
    admin.close()

    async def look() -> tuple[list[str], list[str]]:
        conn = aioredis.Redis.from_url(redis_server.url)
        try:
            fleet = Fleet(conn, KEYS, "default", cache_s=0)
            consumers = sorted(d.consumer for d in await fleet.daemons())
            return consumers, await fleet.models()
        finally:
            await conn.aclose()

    consumers, models = asyncio.run(look())
    assert consumers == ["a", "b"]
    assert models == ["tiny"]  # a local path is shown by its last part only
