"""The hub: one connection follows many jobs, keeping the follower's promises."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from batchd.producers.errors import JobNotFound
from batchd.producers.gateway.serving.connections import reader
from batchd.producers.gateway.serving.hub import Hub, running
from batchd.producers.keys import Keys, event_id
from batchd.producers.schema import Event, FinishReason, JobState, JobStatus
from support.redis_server import RedisServer

KEYS = Keys("batchd")


async def write_event(conn: aioredis.Redis, job_id: str, event: Event) -> None:
    await conn.xadd(KEYS.events(job_id), {"event": event.encode()}, id=event_id(event.seq))


async def set_status(conn: aioredis.Redis, job_id: str, state: JobState, **extra: object) -> None:
    status = JobStatus(state=state, queue="default", queued_at=time.time(), **extra)  # type: ignore[arg-type]
    await conn.hset(KEYS.job(job_id), mapping=status.to_hash())


def test_many_jobs_one_connection_in_order_and_at_once(redis_server: RedisServer) -> None:
    async def run() -> None:
        conn = aioredis.Redis.from_url(redis_server.url)
        hub = Hub(reader(redis_server.url, block_ms=5000), conn, KEYS, block_ms=5000)
        async with running(hub):
            jobs = [f"j{i}" for i in range(50)]
            for job in jobs:
                await set_status(conn, job, JobState.running)

            async def follow(job: str) -> tuple[list[str], float]:
                async with hub.subscribe(job) as sub:
                    texts = []
                    async for event in sub.events():
                        texts.append(event.text)
                    return texts, time.monotonic()

            tasks = [asyncio.ensure_future(follow(j)) for j in jobs]
            await asyncio.sleep(0.2)  # the hub's read blocks (5 s) while nothing comes
            assert hub.followed == 50
            started = time.monotonic()
            for job in jobs:
                for seq in range(3):
                    await write_event(conn, job, Event(seq=seq, token_id=seq, text=f"t{seq}"))
                final = Event(seq=3, finish_reason=FinishReason.stop, text="t0t1t2")
                await write_event(conn, job, final)
            results = await asyncio.gather(*tasks)
            assert all(texts == ["t0", "t1", "t2", "t0t1t2"] for texts, _ in results)
            # Woken, not waiting out its 5 s block.
            assert max(done for _, done in results) - started < 2.0
            assert hub.followed == 0
        await conn.aclose()
        await hub.conn.aclose()

    asyncio.run(run())


def test_a_new_job_wakes_the_blocked_read(redis_server: RedisServer) -> None:
    async def run() -> float:
        conn = aioredis.Redis.from_url(redis_server.url)
        hub = Hub(reader(redis_server.url, block_ms=10_000), conn, KEYS, block_ms=10_000)
        async with running(hub):
            await set_status(conn, "idle", JobState.running)
            async with hub.subscribe("idle"):  # the hub blocks on this one
                await asyncio.sleep(0.3)
                await set_status(conn, "late", JobState.running)
                await write_event(conn, "late", Event(seq=0, finish_reason=FinishReason.stop))
                started = time.monotonic()
                async with hub.subscribe("late") as sub:
                    event = await sub.get(5)
                took = time.monotonic() - started
        assert event is not None and event.final
        await conn.aclose()
        await hub.conn.aclose()
        return took

    assert asyncio.run(run()) < 1.0


def test_an_ending_without_final_event_and_a_missing_job(redis_server: RedisServer) -> None:
    async def run() -> None:
        conn = aioredis.Redis.from_url(redis_server.url)
        hub = Hub(
            reader(redis_server.url, block_ms=1000),
            conn,
            KEYS,
            status_interval_s=0.1,
            missing_timeout_s=0.3,
        )
        async with running(hub):
            await set_status(conn, "dead", JobState.failed, error="poison")
            async with hub.subscribe("dead") as sub:
                event = await sub.get(5)
            assert event is not None and event.finish_reason is FinishReason.error
            async with hub.subscribe("nobody") as sub:
                with pytest.raises(JobNotFound):
                    await sub.get(5)
        await conn.aclose()
        await hub.conn.aclose()

    asyncio.run(run())
