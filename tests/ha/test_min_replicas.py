"""A master that lost its replicas under ``min-replicas-to-write`` (the setting that keeps a
master cut off from its replicas from acknowledging writes no replica will have) refuses
every write with NOREPLICAS. The daemon keeps its work in memory and backs off, as for any
refused write, and once the replicas are back every job ends exactly once."""

from __future__ import annotations

import time

from faults.checks import KEYS, assert_all_done_once, fake_jobs

from support.daemon_harness import FakeGenerator, enqueue, fast_settings, wait_until, worker_thread
from support.redis_server import RedisServer


def test_noreplicas_refusals_lose_nothing(redis_server: RedisServer) -> None:
    client = redis_server.client()
    jobs = fake_jobs(4, prefix="norepl", max_tokens=60)
    settings = fast_settings(redis_server.url)
    with worker_thread(settings, lambda: FakeGenerator(step_delay_s=0.01)) as worker:
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(lambda: client.xlen(KEYS.events("norepl0")) > 0, what="first tokens")
        client.config_set("min-replicas-to-write", 1)  # no replica: every write refused
        wait_until(lambda: worker.backoff.down, what="writes refused (NOREPLICAS)")
        time.sleep(0.5)
        assert worker.heartbeat._thread.is_alive()
        client.config_set("min-replicas-to-write", 0)
        assert_all_done_once(client, jobs)
