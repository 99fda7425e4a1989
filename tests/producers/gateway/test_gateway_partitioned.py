"""The gateway's Redis side on a partitioned layout (a plain redis-server in 3
partitions, and a real Redis Cluster): its clients as the app opens them, a submit
landing in the job's partition, the backlog summed over partitions, and the hub
following jobs of every partition (on a Cluster: a blocked read per partition), woken
at once rather than at the end of its block."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.cluster import RedisCluster

from batchd.producers.aio import AsyncClient
from batchd.producers.connection import is_cluster
from batchd.producers.gateway.fleet import Fleet
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving.connections import commands, reader
from batchd.producers.gateway.serving.hub import Hub, running
from batchd.producers.gateway.serving.metrics import connections
from batchd.producers.keys import EVENT_FIELD, event_id
from batchd.producers.schema import Event, FinishReason, JobState
from support.partitions import PARTITIONS, Partitioned

IDS = [f"g{i}" for i in range(12)]
# The hub's blocked reads: far longer than any wait on a loaded host.
BLOCK_S = 30


def test_submits_land_in_their_partition_and_the_backlog_sums_them(
    partitioned: Partitioned,
) -> None:
    keys = partitioned.keys

    async def main() -> tuple[int, tuple[float, float]]:
        pooled = commands(partitioned.url, GatewayOptions())
        assert is_cluster(pooled) is partitioned.cluster
        client = AsyncClient(pooled)
        try:
            for job_id in IDS:
                await client.submit_request(
                    {"prompt": "hi", "id": job_id}, queue=None, idempotent=False
                )
            backlog = await Fleet(pooled, client.layout, "default", backlog_cache_s=0).backlog()
            return backlog, connections(pooled)
        finally:
            await client.aclose()

    backlog, (in_use, opened) = asyncio.run(main())
    assert backlog == len(IDS)
    # The metrics' view of the command client: idle connections, one per node at least.
    assert in_use == 0 and opened >= (3 if partitioned.cluster else 1)
    for k in range(PARTITIONS):
        expected = sum(1 for job_id in IDS if keys.partition(job_id) == k)
        assert partitioned.admin.xlen(keys.queue("default", k)) == expected > 0


def test_the_hub_follows_every_partition_and_is_woken(partitioned: Partitioned) -> None:
    keys, admin = partitioned.keys, partitioned.admin
    for job_id in IDS:
        admin.hset(keys.job(job_id), "state", JobState.running.value)

    async def main() -> tuple[dict[str, list[str]], float]:
        pooled = commands(partitioned.url, GatewayOptions())
        client = AsyncClient(pooled)
        block_ms = BLOCK_S * 1000
        hub = Hub(
            reader(partitioned.url, block_ms=block_ms), pooled, client.layout, block_ms=block_ms
        )
        try:
            async with running(hub):

                async def follow(job_id: str) -> list[str]:
                    async with hub.subscribe(job_id) as sub:
                        return [event.text or "" async for event in sub.events()]

                tasks = {job_id: asyncio.ensure_future(follow(job_id)) for job_id in IDS}
                deadline = time.monotonic() + 30  # the first layout read opens the cluster
                while hub.followed < len(IDS) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert hub.followed == len(IDS)
                assert len(hub._lanes) == (PARTITIONS if partitioned.cluster else 1)
                # Every lane's read is blocked in Redis while nothing comes.
                while blocked_reads(admin) < len(hub._lanes) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert blocked_reads(admin) == len(hub._lanes)
                started = time.monotonic()
                for job_id in IDS:
                    for event in (
                        Event(seq=0, token_id=1, text=f"{job_id}-a"),
                        Event(seq=1, finish_reason=FinishReason.stop, text="end"),
                    ):
                        entry = {EVENT_FIELD: event.encode()}
                        await pooled.xadd(keys.events(job_id), entry, id=event_id(event.seq))
                texts = {job_id: await task for job_id, task in tasks.items()}
                return texts, time.monotonic() - started
        finally:
            await client.aclose()
            await hub.conn.aclose()

    texts, took = asyncio.run(main())
    assert texts == {job_id: [f"{job_id}-a", "end"] for job_id in IDS}
    # Read as written, not at the end of the block: the block is long so that a loaded
    # host's slowness cannot be mistaken for it.
    assert took < BLOCK_S / 2, took


def blocked_reads(admin: Any) -> int:
    """Clients blocked in a read on the server (every node of a Cluster)."""
    if not isinstance(admin, RedisCluster):
        return int(admin.info("clients")["blocked_clients"])
    info = admin.info("clients", target_nodes=RedisCluster.ALL_NODES)
    return sum(int(node["blocked_clients"]) for node in info.values())
