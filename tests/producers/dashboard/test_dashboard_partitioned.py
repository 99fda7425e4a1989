"""The dashboard's records on a partitioned layout (a plain redis-server in 3 partitions,
and a real Redis Cluster): the overview's queue rows summed over partitions, dead
letters merged from every partition's stream and found again by name, a job's page
finding its request in its partition, and the job search."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from batchd.producers.client import Client
from batchd.producers.connection import async_redis_client, claim_layout
from batchd.producers.dashboard.app import create_app
from batchd.producers.dashboard.fleet.latency import LatencyCollector
from batchd.producers.dashboard.fleet.probe import Prober
from batchd.producers.dashboard.options import DashboardOptions
from batchd.producers.dashboard.records.dead import count_letters, read_letter, read_letters
from batchd.producers.dashboard.records.jobs import load_job
from batchd.producers.dashboard.records.search import JobQuery, search
from batchd.producers.keys import CONSUMER_GROUP, DEFAULT_PREFIX, Keys
from batchd.producers.schema import Event, FinishReason, Timings, Usage
from support.partitions import PARTITIONS, Partitioned
from support.redis_server import RedisServer

IDS = [f"d{i}" for i in range(12)]


def test_queue_rows_and_dead_letters_over_partitions(partitioned: Partitioned) -> None:
    keys, admin = partitioned.keys, partitioned.admin
    with Client(partitioned.url, block_ms=200) as client:
        client.submit_many([{"prompt": "p", "id": job_id, "metadata": {"k": 1}} for job_id in IDS])
    for stream in keys.queue_partitions("default"):
        admin.xgroup_create(stream, CONSUMER_GROUP, id="0")
        admin.xreadgroup(CONSUMER_GROUP, "d1", {stream: ">"}, count=1)
    letters = []
    for k in range(PARTITIONS):  # the same entry id in every partition's stream
        admin.xadd(keys.dead_stream(k), {"id": f"x{k}", "queue": "default"}, id=f"{1000 + k}-0")
        admin.xadd(keys.dead_stream(k), {"id": f"y{k}", "queue": "default"}, id="5000-0")
        letters.append(f"x{k}")

    async def main() -> tuple[Any, ...]:
        conn = async_redis_client(partitioned.url)
        try:
            fleet = await Prober(conn, keys).probe()
            newest = await read_letters(conn, keys, count=4)
            older = await read_letters(conn, keys, count=10, before=newest[-1].entry)
            again = await read_letter(conn, keys, newest[-1].entry)
            return fleet, newest, older, again, await count_letters(conn, keys)
        finally:
            await conn.aclose()

    fleet, newest, older, again, total = asyncio.run(main())
    [row] = fleet.queues
    assert (row.name, row.length, row.pending, row.unread) == ("default", 12, PARTITIONS, 9)
    assert row.consumers == 1 and row.bands["normal"] == 9
    assert fleet.dead_letters == total == 2 * PARTITIONS
    assert {letter.job_id for letter in newest[:PARTITIONS]} == {f"y{k}" for k in range(3)}
    assert newest[-1].job_id == f"x{PARTITIONS - 1}"
    assert [letter.job_id for letter in older] == [f"x{k}" for k in reversed(range(2))]
    assert again is not None and again.job_id == newest[-1].job_id


def test_a_jobs_page_and_the_search_over_partitions(partitioned: Partitioned) -> None:
    keys = partitioned.keys
    with Client(partitioned.url, block_ms=200) as client:
        for job_id in IDS:
            client.submit("hi", id=job_id, metadata={"team": job_id})

    async def main() -> tuple[Any, ...]:
        conn = async_redis_client(partitioned.url)
        try:
            page = await load_job(conn, keys, IDS[4])
            exact = await search(conn, keys, JobQuery(id=IDS[4]))
            prefix = await search(conn, keys, JobQuery(id="d1"))
            meta = await search(conn, keys, JobQuery(id="d", meta=f"team={IDS[7]}"))
            return page, exact, prefix, meta
        finally:
            await conn.aclose()

    page, exact, prefix, meta = asyncio.run(main())
    assert page is not None and page.request is not None
    assert page.request["metadata"] == {"team": IDS[4]}
    assert [row.id for row in exact.rows] == [IDS[4]]
    if partitioned.cluster:  # one SCAN cursor per node: an exact id only
        assert [row.id for row in prefix.rows] == ["d1"]
        return
    assert sorted(row.id for row in prefix.rows) == ["d1", "d10", "d11"]
    assert [row.id for row in meta.rows] == [IDS[7]]


def test_the_dashboard_serves_a_partitioned_deployment(
    partitioned: Partitioned, caplog: pytest.LogCaptureFixture
) -> None:
    """Its pages list the queue once and the job in its partition; on a Cluster the
    latency collector stays off (no pattern subscription there), and says why."""
    with Client(partitioned.url, block_ms=200) as client:
        client.submit("hi", id="shown", queue="fast")
    caplog.set_level(logging.INFO, logger="batchd.producers.dashboard.app")
    app = create_app(partitioned.url, DashboardOptions(operator_keys=[]))
    with TestClient(app) as http:
        overview = http.get("/")
        job = http.get("/jobs/shown")
    assert overview.status_code == 200 and overview.text.count(">fast<") == 1
    assert job.status_code == 200 and "queued" in job.text
    off = "latency charts off: Redis Cluster" in caplog.text
    assert off is partitioned.cluster


def test_a_dashboard_started_before_the_first_daemon_follows_its_layout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Started on a Redis where no daemon stored the layout yet, the dashboard uses one
    partition's names; once a daemon of a 3-partition deployment stores its layout, the
    next refreshes list that deployment's queue and find a job in its partition, with
    no restart."""
    server = RedisServer(tmp_path / "redis").start()
    admin = server.client()
    try:
        caplog.set_level(logging.INFO, logger="batchd.producers.dashboard")
        options = DashboardOptions(operator_keys=[], refresh_s=0.2, discovery_s=0.2)
        app = create_app(server.url, options)
        with TestClient(app) as http:
            assert "no daemon has stored the key layout" in caplog.text
            keys = claim_layout(admin, DEFAULT_PREFIX, PARTITIONS)  # the first daemon
            with Client(server.url, block_ms=200) as client:
                client.submit("hi", id="later", queue="tagged")
            assert admin.exists(keys.queue_for("tagged", "later"))
            deadline = time.monotonic() + 30
            while ">tagged<" not in (overview := http.get("/")).text:
                assert time.monotonic() < deadline, "the queue never appeared"
                time.sleep(0.1)
            job = http.get("/jobs/later")
        assert overview.text.count(">tagged<") == 1
        assert job.status_code == 200 and "queued" in job.text
        assert "the key layout is stored now: 3 partition(s)" in caplog.text
    finally:
        admin.close()
        server.kill()


def test_the_latency_listener_subscribes_again_to_a_new_layouts_channels(
    tmp_path: Path,
) -> None:
    """Token channels of a partitioned layout are named with the partition's tag: once
    the collector is handed that layout's names, it hears a job finish on them."""
    server = RedisServer(tmp_path / "redis").start()
    admin = server.client()
    tagged = Keys(DEFAULT_PREFIX, PARTITIONS)
    done = Event.model_validate(
        {
            "seq": 1,
            "text": "hi",
            "finish_reason": FinishReason.stop,
            "usage": Usage(prompt_tokens=1, completion_tokens=2),
            "timings": Timings(queued=1.0, started=1.5, first_token=2.0, finished=3.0),
        }
    ).encode()

    async def main() -> list[str]:
        conn = async_redis_client(server.url)
        collector = LatencyCollector(Keys(DEFAULT_PREFIX))
        listening = asyncio.ensure_future(collector.run(conn))
        try:
            await asyncio.sleep(0.3)
            collector.keys = tagged  # what the sampler does once the layout is stored
            deadline = time.monotonic() + 30
            while not collector.finished:
                assert time.monotonic() < deadline, "the tagged channel was never heard"
                admin.publish(tagged.tokens("j1"), done)
                await asyncio.sleep(0.2)
            return [f.job_id for f in collector.finished]
        finally:
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
            await conn.aclose()

    try:
        assert asyncio.run(main())[0] == "j1"
    finally:
        admin.close()
        server.kill()
