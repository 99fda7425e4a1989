"""Following jobs while the primary of their partition is killed (a real Redis Cluster):
the sync client's follower and the gateway's hub wait out the failover (connection
errors, CLUSTERDOWN while the replica is promoted; redis-py's cluster client is made to
read the slots again) and deliver every event once, in order, from the promoted replica.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from batchd.daemon.cluster_server import cluster_deployment, has_cluster_cli
from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client, follow
from batchd.producers.connection import claim_layout
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving.connections import commands, reader
from batchd.producers.gateway.serving.hub import Hub, running
from batchd.producers.keys import EVENT_FIELD, event_id
from batchd.producers.schema import Event, FinishReason, JobState

IDS = [f"f{i}" for i in range(6)]
TOKENS = 20
EXPECTED = "".join(chr(97 + seq) for seq in range(TOKENS))

Texts = dict[str, str]


def with_client(url: str, texts: Texts, ready: threading.Event) -> None:
    """The sync client's follower over every job."""
    with Client(url, block_ms=200) as client:
        follower = client.follower(timeout=60)
        for job_id in IDS:
            follower.add(job_id)
        ready.set()
        for job_id, event in follow(client.redis, follower):
            if not event.final:
                texts[job_id] = texts.get(job_id, "") + (event.text or "")


def with_hub(url: str, texts: Texts, ready: threading.Event) -> None:
    """The gateway's hub (its own clients, as the app opens them) over every job."""

    async def main() -> None:
        pooled = commands(url, GatewayOptions())
        client = AsyncClient(pooled)
        hub = Hub(reader(url, block_ms=1000), pooled, client.layout, block_ms=1000)
        try:
            async with running(hub):

                async def one(job_id: str) -> None:
                    async with hub.subscribe(job_id) as sub:
                        async for event in sub.events():
                            if not event.final:
                                texts[job_id] = texts.get(job_id, "") + (event.text or "")

                tasks = [asyncio.ensure_future(one(job_id)) for job_id in IDS]
                while hub.followed < len(IDS):
                    await asyncio.sleep(0.02)
                ready.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            await client.aclose()
            await hub.conn.aclose()

    asyncio.run(main())


@pytest.mark.skipif(not has_cluster_cli(), reason="redis-cli --cluster not available")
@pytest.mark.parametrize("reader_of", [with_client, with_hub], ids=["client", "hub"])
def test_a_follower_outlasts_the_kill_of_its_partitions_primary(
    tmp_path: Path, reader_of: Callable[[str, Texts, threading.Event], None]
) -> None:
    with cluster_deployment(tmp_path / "cluster") as cluster:
        admin = cluster.client()
        keys = claim_layout(admin, "batchd", 3)
        for job_id in IDS:
            admin.hset(keys.job(job_id), "state", JobState.running.value)
        texts: Texts = {}
        ready = threading.Event()
        thread = threading.Thread(target=reader_of, args=(cluster.url, texts, ready))
        thread.start()
        assert ready.wait(30)
        primary = admin.get_node_from_key(keys.job(IDS[0]))
        for seq in range(TOKENS):
            if seq == TOKENS // 2:  # once the replica holds what was written so far
                admin.wait(1, 5000, target_nodes=primary)
                cluster.kill_primary(slot=admin.keyslot(keys.job(IDS[0])))
            for job_id in IDS:
                event = Event(seq=seq, token_id=seq, text=chr(97 + seq))
                admin.xadd(keys.events(job_id), {EVENT_FIELD: event.encode()}, id=event_id(seq))
            time.sleep(0.01)
        for job_id in IDS:
            final = Event(seq=TOKENS, finish_reason=FinishReason.stop)
            admin.xadd(keys.events(job_id), {EVENT_FIELD: final.encode()}, id=event_id(TOKENS))
            admin.hset(keys.job(job_id), "state", JobState.finished.value)
        thread.join(60)
        admin.close()
    assert texts == {job_id: EXPECTED for job_id in IDS}
