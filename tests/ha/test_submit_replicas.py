"""``replicas`` of the clients: a submit returns only once that many replicas hold the job
(Redis WAIT), so a failover right after a submit returned cannot lose the job."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client
from batchd.producers.errors import NotReplicated
from batchd.producers.keys import Keys
from support.daemon_harness import wait_until
from support.redis_server import RedisServer
from support.sentinel import SYNC_AT_ONCE

KEYS = Keys()
STOPPED_S = 0.4


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and one replica in sync with it."""
    master = RedisServer(tmp_path / "master", extra_args=SYNC_AT_ONCE).start()
    replica = RedisServer(
        tmp_path / "replica", extra_args=["--replicaof", "127.0.0.1", str(master.port)]
    ).start()
    with replica.client() as conn:
        up = lambda: _info(conn).get("master_link_status") == "up"  # noqa: E731
        wait_until(up, what="replica in sync")
    yield master, replica
    replica.kill()
    master.kill()


def _info(conn: Any) -> dict[str, Any]:
    info: dict[str, Any] = conn.info("replication")
    return info


def test_a_submit_waits_for_its_replica(pair: tuple[RedisServer, RedisServer]) -> None:
    master, replica = pair
    assert replica.proc is not None
    with Client(master.url, replicas=1, replicas_timeout_ms=5000) as client:
        client.submit("warm up", max_tokens=1)  # the scripts are loaded, the pool is open
        os.kill(replica.proc.pid, signal.SIGSTOP)  # the replica confirms nothing meanwhile
        resume = threading.Timer(STOPPED_S, os.kill, (replica.proc.pid, signal.SIGCONT))
        resume.start()
        started = time.monotonic()
        job = client.submit("Hello", max_tokens=4)
        took = time.monotonic() - started
        resume.join()
    assert took >= STOPPED_S * 0.9, f"the submit returned after {took:.3f}s, before its replica"
    with replica.client() as conn:
        assert conn.hget(KEYS.job(job.id), "state") == b"queued"


def test_too_few_replicas_raise_and_leave_the_job_on_the_master(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, _ = pair
    # Long enough for a loaded host's replica to confirm: the one replica is counted.
    with Client(master.url, replicas=2, replicas_timeout_ms=5000) as client:
        with pytest.raises(NotReplicated) as caught:
            client.submit("Hello", id="wait-2", max_tokens=4)
        assert (caught.value.acked, caught.value.wanted, caught.value.job_ids) == (1, 2, ["wait-2"])
        with pytest.raises(NotReplicated):
            client.submit_many([{"prompt": "a", "id": "many-1"}, {"prompt": "b", "id": "many-2"}])
    with master.client() as conn:
        assert conn.hget(KEYS.job("wait-2"), "state") == b"queued"
        assert conn.exists(KEYS.job("many-1"), KEYS.job("many-2")) == 2


def test_the_async_client_waits_too(pair: tuple[RedisServer, RedisServer]) -> None:
    master, replica = pair

    async def submit() -> str:
        async with AsyncClient(master.url, replicas=1) as client:
            job = await client.submit("Hello", max_tokens=4)
            with pytest.raises(NotReplicated):
                async with AsyncClient(master.url, replicas=2, replicas_timeout_ms=100) as two:
                    await two.submit("Hello", max_tokens=4)
            return job.id

    job_id = asyncio.run(submit())
    with replica.client() as conn:
        assert conn.hget(KEYS.job(job_id), "state") == b"queued"
