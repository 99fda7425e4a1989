"""A failover to a replica that lags: the writes the old master acknowledged after its
replica stopped following it (tokens, final events, queue reads, acks) are lost with it.
The daemon finds each job's stream shorter than it believes on the new master and
starts the job over from what it holds; every job still ends exactly once with the
tokens of an uninterrupted run, and nothing is left pending."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from faults.checks import KEYS, assert_all_done_once, fake_jobs

from batchd.producers.connection import redis_client
from support.daemon_harness import FakeGenerator, enqueue, fast_settings, wait_until, worker_thread
from support.sentinel import sentinel_deployment


def test_failover_to_a_lagging_replica_loses_nothing(tmp_path: Path) -> None:
    jobs = fake_jobs(9, prefix="lag", max_tokens=120)
    with sentinel_deployment(tmp_path / "redis", down_after_ms=1000) as deployment:
        settings = fast_settings(deployment.url)
        make = lambda: FakeGenerator(max_running=3, step_delay_s=0.01)  # noqa: E731
        with worker_thread(settings, make):
            client = redis_client(deployment.url, socket_timeout=5, socket_connect_timeout=2)
            for job in jobs:
                enqueue(client, KEYS, job)
            old = deployment.master.client()
            wait_until(lambda: old.xlen(KEYS.events("lag0")) >= 10, what="first tokens")
            replica = deployment.replicas[0].client()
            # The replica stops following: it cannot log in again once its link drops.
            replica.config_set("masteruser", "no-such-user")
            replica.config_set("masterauth", "no-such-password")
            replica.client_kill_filter(_type="master")
            time.sleep(1.0)  # the master acknowledges writes its replica will never have
            ahead = _lengths(old, jobs)
            behind = _lengths(replica, jobs)
            assert any(ahead[j] > behind[j] for j in ahead), (ahead, behind)
            deployment.kill_master()
            assert_all_done_once(client, jobs, timeout=60)
            client.close()


def _lengths(conn: Any, jobs: list[dict[str, Any]]) -> dict[str, int]:
    return {job["id"]: int(conn.xlen(KEYS.events(job["id"]))) for job in jobs}
