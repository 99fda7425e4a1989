"""The deployment's key layout (``<prefix>:layout``) on one redis-server with queues in
3 partitions, under the faults that would make a process read another one: producers
used before the first daemon stored it, the key lost under running daemons, another
layout stored under a running daemon, and a Redis that refuses to store it (an ACL
user, OOM under noeviction)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
from faults.checks import assert_all_done_once

from batchd.config.sections import GatewaySettings
from batchd.daemon.worker.loop import Worker
from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client
from batchd.producers.connection.layout import LayoutMismatch, LayoutNotWritable
from batchd.producers.errors import JobNotFound
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving.server import uvicorn_config
from batchd.producers.keys import Keys
from batchd.producers.schema import FinishReason
from support.asgi import serve_in_thread
from support.daemon_harness import FakeGenerator, wait_until, worker_thread
from support.partitions import PARTITIONS, id_in, partitioned, spread, submit
from support.redis_server import RedisServer, free_port

KEYS = Keys("batchd", PARTITIONS)
API_KEY = "sk-test-layout"
# One job id in each partition, so that a job lands on every partition's stream.
IDS = [id_in(KEYS, k, f"early{k}-") for k in range(PARTITIONS)]


def test_a_client_used_before_the_first_daemon_reads_the_layout_it_stored(
    redis_server: RedisServer,
) -> None:
    """A producer that read the layout before any daemon stored it (one partition) must
    not keep that answer: its jobs would go to names no daemon of 3 partitions reads."""
    with Client(redis_server.url, block_ms=200) as client:
        with pytest.raises(JobNotFound):
            client.status(IDS[0])  # a first use, before any daemon
        assert client.keys == Keys()
        with worker_thread(partitioned(redis_server.url), FakeGenerator):
            handles = [client.submit("hi", id=job_id, max_tokens=4) for job_id in IDS]
            assert client.keys == KEYS
            for handle in handles:
                assert handle.result(timeout=30).finish_reason is FinishReason.length
    assert not redis_server.client().exists(Keys().queue())


def test_jobs_queued_before_the_first_daemon_are_reported_by_it(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """What a producer submitted before any daemon went to the one-partition names, which
    a daemon of 3 partitions does not read: the daemon that stores the layout says so."""
    with Client(redis_server.url, block_ms=200) as client:
        client.submit("hi", id="too-early", max_tokens=4)
    with (
        caplog.at_level(logging.ERROR, logger="batchd.daemon.worker.redis_io"),
        worker_thread(partitioned(redis_server.url), FakeGenerator),
    ):
        pass
    assert f"{Keys().queue()} holds 1 job(s) queued under the one-partition names" in caplog.text


def test_an_async_client_used_before_the_first_daemon_reads_the_layout_it_stored(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        async with AsyncClient(redis_server.url, block_ms=200) as client:
            with pytest.raises(JobNotFound):
                await client.status(IDS[0])
            assert client.keys == Keys()
            with worker_thread(partitioned(redis_server.url), FakeGenerator):
                handles = [await client.submit("hi", id=job_id, max_tokens=4) for job_id in IDS]
                assert client.keys == KEYS
                for handle in handles:
                    result = await handle.result(timeout=30)
                    assert result.finish_reason is FinishReason.length

    asyncio.run(main())
    assert not redis_server.client().exists(Keys().queue())


def test_a_layout_lost_under_a_running_daemon_is_stored_again(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis_server.client()
    with (
        caplog.at_level(logging.WARNING, logger="batchd.daemon.fleet.heartbeat"),
        worker_thread(partitioned(redis_server.url), FakeGenerator),
    ):
        assert orjson.loads(admin.get(KEYS.layout)) == {"partitions": PARTITIONS}
        admin.delete(KEYS.layout)  # as a FLUSHALL, a restart without persistence, an eviction
        wait_until(lambda: bool(admin.exists(KEYS.layout)), what="the layout stored again")
        assert orjson.loads(admin.get(KEYS.layout)) == {"partitions": PARTITIONS}
        with Client(redis_server.url, block_ms=200) as client:  # started after the loss
            handles = [client.submit("hi", id=job_id, max_tokens=4) for job_id in IDS]
            for handle in handles:
                assert handle.result(timeout=30).finish_reason is FinishReason.length
    assert f"the key layout {KEYS.layout} was lost" in caplog.text


@contextmanager
def running(worker: Worker) -> Iterator[Future[None]]:
    """``worker.run()`` on a thread of its own (its end, or what it raised: the future);
    stopped as by SIGTERM twice at the end, if still running."""
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        run = pool.submit(worker.run)
        try:
            yield run
        finally:
            worker.request_stop()
            worker.request_stop()


def test_another_layout_stored_under_a_running_daemon_stops_it_after_its_jobs(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Laid out anew under it (the key lost, then claimed by a daemon of 2 partitions):
    the daemon takes no new job, finishes the ones it holds, and exits LayoutMismatch."""
    admin = redis_server.client()
    generator = FakeGenerator(step_delay_s=0.02)
    worker = Worker(partitioned(redis_server.url), generator, consumer="old")
    held = spread(3, "held", KEYS, max_tokens=40)
    with caplog.at_level(logging.ERROR, logger="batchd.daemon.fleet.heartbeat"):
        with running(worker) as run:
            wait_until(worker.heartbeat._thread.is_alive, what="worker serving")
            for job in held:
                submit(admin, KEYS, job)
            wait_until(lambda: len(generator.started) == len(held), what="jobs started")
            admin.set(KEYS.layout, orjson.dumps({"partitions": 2}))
            wait_until(lambda: worker.stop.stopping, what="intake stopped")
            late = spread(3, "late", KEYS)
            for job in late:
                submit(admin, KEYS, job)
            wait_until(run.done, what="the worker to exit")
    error = run.exception()
    assert isinstance(error, LayoutMismatch) and "queue.partitions is 3" in str(error)
    assert "another key layout was stored under this daemon" in caplog.text
    assert_all_done_once(admin, held, keys=KEYS)
    assert not set(generator.started) & {job["id"] for job in late}
    assert orjson.loads(admin.get(KEYS.layout)) == {"partitions": 2}  # not overwritten


def _acl_user(admin: Any, name: str, *rules: str) -> str:
    """A Redis user with ``rules`` (key patterns), every command and channel; its URL's
    credentials part."""
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw", "+@all", "&*", *rules)
    return f"{name}:pw"


def test_a_daemon_whose_user_may_not_store_the_layout_refuses_naming_the_grant(
    redis_server: RedisServer,
) -> None:
    admin = redis_server.client()
    login = _acl_user(admin, "reader", "%R~*")
    url = f"redis://{login}@127.0.0.1:{redis_server.port}/0"
    worker = Worker(partitioned(url), FakeGenerator(), consumer="reader")
    with pytest.raises(LayoutNotWritable) as refused:
        worker.run()
    message = str(refused.value)
    assert KEYS.layout in message and "ACL SETUSER" in message and "NOPERM" in message
    assert not admin.exists(KEYS.layout) and not admin.exists(KEYS.daemon("reader"))


def test_a_daemon_that_may_only_read_a_matching_stored_layout_serves(
    redis_server: RedisServer,
) -> None:
    """Its user may write every key but the layout (``batchd:layout`` is the prefix's
    only key that starts with an ``l``), which an administrator stored."""
    admin = redis_server.client()
    admin.set(KEYS.layout, orjson.dumps({"partitions": PARTITIONS}))
    login = _acl_user(admin, "worker", "~batchd:[^l]*", "%R~batchd:layout")
    url = f"redis://{login}@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(redis.exceptions.NoPermissionError):  # it cannot write it indeed
        redis.Redis.from_url(url).set(KEYS.layout, b"{}")
    jobs = spread(6, "ro", KEYS)
    with worker_thread(partitioned(url), FakeGenerator):
        for job in jobs:
            submit(admin, KEYS, job)
        assert_all_done_once(admin, jobs, keys=KEYS)


def test_a_daemon_started_on_a_full_redis_waits_naming_the_layout_then_serves(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """OOM under noeviction passes (memory is freed, maxmemory raised): the daemon waits,
    saying what it cannot store and what to do, as it waits out any refused write."""
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    worker = Worker(partitioned(redis_server.url), FakeGenerator(), consumer="full")
    jobs = spread(3, "full", KEYS)
    try:
        with caplog.at_level(logging.WARNING), running(worker) as run:
            wait_until(lambda: worker.backoff.down, what="the claim refused")
            assert not admin.exists(KEYS.layout)
            admin.config_set("maxmemory", 0)
            wait_until(worker.heartbeat._thread.is_alive, what="worker serving")
            for job in jobs:
                submit(admin, KEYS, job)
            assert_all_done_once(admin, jobs, keys=KEYS)
    finally:
        admin.config_set("maxmemory", 0)
    assert run.exception() is None
    assert f"cannot store the layout {KEYS.layout}" in caplog.text
    assert "raise maxmemory" in caplog.text
    assert orjson.loads(admin.get(KEYS.layout)) == {"partitions": PARTITIONS}


def test_a_gateway_asked_before_the_first_daemon_reads_the_layout_it_stored(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The gateway's first request, before any daemon, reads the layout (to find the
    model's daemons) and is refused; the requests after the daemon started complete."""
    options = GatewayOptions(api_keys=[API_KEY], files_dir=tmp_path)
    settings = GatewaySettings(host="127.0.0.1", port=free_port())
    config = uvicorn_config(create_app(redis_server.url, options), settings, log_level="warning")
    daemon = partitioned(redis_server.url)
    daemon.model = "fake"
    with serve_in_thread(config) as url:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.NotFoundError, match="no live daemon serves it"):
            oai.completions.create(model="fake", prompt="hi", max_tokens=4)
        with worker_thread(daemon, FakeGenerator):
            listed = lambda: [m.id for m in oai.models.list().data] == ["fake"]  # noqa: E731
            wait_until(listed, what="the daemon listed (its heartbeats are cached 1 s)")
            for _ in range(2 * PARTITIONS):  # random ids: most partitions get one
                done = oai.completions.create(model="fake", prompt="hi", max_tokens=4)
                assert done.choices[0].finish_reason == "length"
        oai.close()
    assert not redis_server.client().exists(Keys().queue())


def test_a_daemon_refuses_a_layout_key_batchd_did_not_write(redis_server: RedisServer) -> None:
    admin = redis_server.client()
    admin.set(KEYS.layout, b"partitions=3")
    worker = Worker(partitioned(redis_server.url), FakeGenerator(), consumer="odd")
    with pytest.raises(LayoutMismatch, match="not a layout.*delete it, or store"):
        worker.run()
    assert admin.get(KEYS.layout) == b"partitions=3"
