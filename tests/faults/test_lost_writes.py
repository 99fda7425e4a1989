"""Scenario 2: Redis loses recent writes while the daemon survives (a restart from an
older RDB snapshot). The daemon notices at its next write for each job (the events
stream does not end where it believes), starts the job over from what Redis holds,
and every job ends with the uninterrupted run's tokens, never gapped or mixed."""

from __future__ import annotations

import time

from faults.checks import KEYS, assert_all_done_once, fake_jobs
from support.daemon_harness import FakeGenerator, enqueue, fast_settings, wait_until, worker_thread
from support.redis_server import RedisServer


def test_restart_from_an_older_snapshot(redis_server: RedisServer) -> None:
    client = redis_server.client()
    jobs = fake_jobs(6, prefix="rdb", max_tokens=60)
    settings = fast_settings(redis_server.url)
    with worker_thread(settings, lambda: FakeGenerator(max_running=3, step_delay_s=0.01)):
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(lambda: client.xlen(KEYS.events("rdb0")) >= 5, what="first tokens")
        client.save()  # the snapshot Redis will come back with
        wait_until(lambda: client.xlen(KEYS.events("rdb0")) >= 30, what="more tokens")
        redis_server.kill()  # what came after the snapshot is lost
        time.sleep(0.3)
        redis_server.start()
        assert_all_done_once(client, jobs)


def test_failover_to_an_empty_replica_loses_the_queue_too(redis_server: RedisServer) -> None:
    """Everything is lost (a replica that never synced took over): the jobs the daemon
    holds still complete from seq 0, and their lost queue entries are only logged."""
    client = redis_server.client()
    jobs = fake_jobs(3, prefix="gone", max_tokens=40)
    with worker_thread(
        fast_settings(redis_server.url), lambda: FakeGenerator(max_running=3, step_delay_s=0.01)
    ):
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(lambda: client.xlen(KEYS.events("gone0")) >= 5, what="first tokens")
        client.flushall()
        assert_all_done_once(client, jobs)
