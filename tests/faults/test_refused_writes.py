"""Scenario 1: Redis refuses writes (OOM under noeviction, READONLY after a failover).

Nothing is dropped: the outbox waits in memory, in order, intake stops, the
heartbeat thread survives, and once Redis takes writes again every job ends
exactly once with the tokens of an uninterrupted run.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from faults.checks import KEYS, assert_all_done_once, fake_jobs
from support.daemon_harness import FakeGenerator, enqueue, fast_settings, wait_until, worker_thread
from support.redis_server import RedisServer, free_port


def _started(client: redis.Redis, job_id: str) -> bool:
    return bool(client.xlen(KEYS.events(job_id)))


# 30 ms: the publish interval, so that the refusals also hit publishes of urgent jobs alone.
@pytest.mark.parametrize("interval_ms", [0, 30])
def test_oom_with_noeviction_loses_nothing(redis_server: RedisServer, interval_ms: int) -> None:
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    jobs = fake_jobs(6, prefix="oom")
    settings = fast_settings(
        redis_server.url, claim_interval_s=0.2, publish_interval_ms=interval_ms
    )
    with worker_thread(settings, lambda: FakeGenerator(max_running=3, step_delay_s=0.01)) as w:
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(lambda: _started(client, "oom0"), what="first tokens")
        client.config_set("maxmemory", 1)  # every write refused from now on
        lengths = [client.xlen(KEYS.events(job["id"])) for job in jobs]
        time.sleep(1.0)
        # Nothing was written, nothing was read beyond the engine's room, nothing acked.
        assert [client.xlen(KEYS.events(job["id"])) for job in jobs] == lengths
        assert w.backoff.down
        assert w.heartbeat._thread.is_alive()
        pending: Any = client.xpending(KEYS.queue(), "batchd")
        assert pending["pending"] <= settings.engine.max_num_seqs + settings.daemon.intake_buffer
        client.config_set("maxmemory", 0)
        assert_all_done_once(client, jobs)
        assert not w.backoff.down and w.heartbeat._thread.is_alive()
        # The key expired while writes were refused; the next beat sets it again.
        wait_until(lambda: bool(client.exists(KEYS.daemon("test-worker"))), what="heartbeat back")


def test_readonly_after_a_failover_and_back(redis_server: RedisServer, tmp_path: Path) -> None:
    """A failover moves the primary to the replica, and the daemon's server, now a
    replica, answers READONLY (and loses what was written in between); then it is
    promoted back. Every job completes exactly once."""
    client = redis_server.client()
    replica = RedisServer(tmp_path / "replica").start()
    try:
        replica.client().replicaof("127.0.0.1", redis_server.port)
        wait_until(lambda: _linked(replica.client()), what="replica in sync")
        jobs = fake_jobs(4, prefix="ro")
        settings = fast_settings(redis_server.url)
        with worker_thread(settings, lambda: FakeGenerator(max_running=4, step_delay_s=0.01)) as w:
            for job in jobs:
                enqueue(client, KEYS, job)
            wait_until(lambda: _started(client, "ro0"), what="first tokens")
            replica.client().replicaof("NO", "ONE")
            client.replicaof("127.0.0.1", replica.port)
            wait_until(lambda: _linked(client), what="old primary now a replica")
            wait_until(lambda: w.backoff.down, what="writes refused (READONLY)")
            client.replicaof("NO", "ONE")
            assert_all_done_once(client, jobs)
    finally:
        replica.kill()


def _linked(client: redis.Redis) -> bool:
    info: Any = client.info("replication")
    return info.get("master_link_status") == "up"


def test_acl_revocation_and_restore_loses_nothing(redis_server: RedisServer) -> None:
    """An operator takes write permissions from the daemon's ACL user (NOPERM on every
    write, scripts included), then gives them back."""
    client = redis_server.client()
    client.acl_setuser("daemon", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"])
    client.acl_setuser("daemon", enabled=True, commands=["+@all"])
    url = f"redis://daemon:pw@127.0.0.1:{redis_server.port}/0"
    jobs = fake_jobs(4, prefix="acl")
    with worker_thread(fast_settings(url), lambda: FakeGenerator(step_delay_s=0.01)) as w:
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(lambda: _started(client, "acl0"), what="first tokens")
        client.acl_setuser("daemon", enabled=True, commands=["-@write"])
        wait_until(lambda: w.backoff.down, what="writes refused (NOPERM)")
        time.sleep(0.5)
        assert w.heartbeat._thread.is_alive()
        client.acl_setuser("daemon", enabled=True, commands=["+@all"])
        assert_all_done_once(client, jobs)


@pytest.mark.parametrize("refusal", ["oom", "readonly"])
def test_a_daemon_started_while_redis_refuses_writes_waits_then_serves(
    redis_server: RedisServer, refusal: str
) -> None:
    """Found by `batchd chaos`: a daemon restarted inside a refused-writes window exited
    with OutOfMemoryError from its first heartbeat instead of waiting the window out."""
    client = redis_server.client()
    if refusal == "oom":
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
        lift = threading.Timer(1.0, lambda: client.config_set("maxmemory", 0))
    else:
        client.replicaof("127.0.0.1", free_port())
        lift = threading.Timer(1.0, lambda: client.replicaof("NO", "ONE"))
    jobs = fake_jobs(3, prefix=f"late-{refusal}")
    started = time.monotonic()
    lift.start()
    try:
        with worker_thread(fast_settings(redis_server.url), FakeGenerator):
            assert time.monotonic() - started >= 1.0
            for job in jobs:
                enqueue(client, KEYS, job)
            assert_all_done_once(client, jobs)
    finally:
        lift.join()
