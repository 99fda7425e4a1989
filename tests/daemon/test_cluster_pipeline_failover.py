"""Pipelines of the connection factory's cluster clients across the kill of a primary (a
real Redis Cluster): the client itself reads the slots again after a pipeline found a
node unreachable, so a caller that sends its pipeline again (as the daemon's loop, the
producers' followers and the gateway's hub do) reaches the replica promoted in the
primary's place, with no re-read of its own.

redis-py 8.1 alone keeps the killed node for good when a sync pipeline's command has
keys it asks its default node for (COMMAND GETKEYS: ZUNION here) and that node is the
one killed: each attempt fails on it before any refresh of the slots.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.cluster import RedisCluster

from batchd.daemon.cluster_server import cluster_deployment, has_cluster_cli
from batchd.producers.connection import async_redis_client, redis_client

pytestmark = pytest.mark.skipif(not has_cluster_cli(), reason="needs redis-cli --cluster")

# Sends of one pipeline: the first may meet the killed node, the next must not.
ATTEMPTS = 3
NODE_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError)
OPTIONS: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}


def keys_on(client: RedisCluster, node: Any) -> tuple[str, str]:
    """A hash and a sorted set in one hash slot that ``node`` serves."""
    tag = next(f"t{i}" for i in range(10_000) if client.get_node_from_key(f"{{t{i}}}") == node)
    return f"{{{tag}}}:status", f"{{{tag}}}:ranked"


def sync_replies(client: redis.Redis, status: str, ranked: str) -> list[Any]:
    """The pipeline's replies, sent again after a node-down error."""
    errors: list[BaseException] = []
    for _ in range(ATTEMPTS):
        try:
            with client.pipeline(transaction=False) as pipe:
                pipe.zunion([ranked])  # movable keys: redis-py asks its default node
                pipe.hget(status, "state")
                return pipe.execute()
        except NODE_DOWN as exc:
            errors.append(exc)
    raise AssertionError(f"every pipeline failed: {errors!r}")


async def async_replies(client: aioredis.Redis, status: str, ranked: str) -> list[Any]:
    """Asyncio twin of :func:`sync_replies`."""
    errors: list[BaseException] = []
    for _ in range(ATTEMPTS):
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.zunion([ranked])
                pipe.hget(status, "state")
                return await pipe.execute()
        except NODE_DOWN as exc:
            errors.append(exc)
    raise AssertionError(f"every pipeline failed: {errors!r}")


def test_pipelines_reach_the_replica_promoted_for_the_killed_default_node(
    tmp_path: Path,
) -> None:
    with cluster_deployment(tmp_path / "cluster") as cluster:
        client: Any = redis_client(cluster.url, **OPTIONS)
        aclient: Any = async_redis_client(cluster.url, **OPTIONS)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(aclient.initialize())
            default = client.get_default_node()
            status, ranked = keys_on(client, default)
            client.hset(status, "state", "running")
            client.zadd(ranked, {"job": 1})
            assert sync_replies(client, status, ranked) == [[b"job"], b"running"]
            assert loop.run_until_complete(async_replies(aclient, status, ranked)) == [
                [b"job"],
                b"running",
            ]
            assert client.wait(1, 5000, target_nodes=default) == 1  # the replica has both
            slot = client.keyslot(status)
            cluster.kill_primary(slot=slot)
            promoted = cluster.owner(slot)
            assert promoted.port != default.port

            assert sync_replies(client, status, ranked) == [[b"job"], b"running"]
            assert client.get_node_from_key(status).port == promoted.port
            replies = loop.run_until_complete(async_replies(aclient, status, ranked))
            assert replies == [[b"job"], b"running"]
            assert aclient.get_node_from_key(status).port == promoted.port
        finally:
            client.close()
            loop.run_until_complete(aclient.aclose())
            loop.close()
