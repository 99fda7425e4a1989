"""Scenario 4: a partition longer than the heartbeat TTL. Daemon A is cut off, B
claims A's job and carries on; when the network heals, A's delayed writes are
fenced off (a later pickup owns the job), A drops the job without writing, and the
job ends once, with B's tokens after A's stored ones, never interleaved."""

from __future__ import annotations

from faults.checks import KEYS, assert_all_done_once, fake_jobs
from faults.proxy import proxy_to
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    fast_settings,
    status_of,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer


def test_partitioned_daemon_never_mixes_its_tokens_with_the_new_owner(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    jobs = fake_jobs(2, prefix="part", max_tokens=80)
    slow = lambda: FakeGenerator(max_running=4, step_delay_s=0.02)  # noqa: E731
    with proxy_to(redis_server.port) as proxy:
        a_settings = fast_settings(proxy.url, block_ms=100)
        with worker_thread(a_settings, slow, consumer="a") as a:
            for job in jobs:
                enqueue(client, KEYS, job)
            wait_until(lambda: len(a.jobs) == 2, what="A holds both jobs")
            wait_until(lambda: client.xlen(KEYS.events("part0")) >= 5, what="A's tokens")
            proxy.pause()
            with worker_thread(fast_settings(redis_server.url), slow, consumer="b") as b:
                wait_until(lambda: len(b.jobs) == 2, timeout=20, what="B claims both jobs")
                proxy.resume()  # A's delayed step reaches Redis now, and is fenced off
                wait_until(lambda: not a.jobs, timeout=20, what="A drops the jobs")
                assert_all_done_once(client, jobs)
    assert {status_of(client, KEYS, job["id"]).daemon for job in jobs} == {"b"}
