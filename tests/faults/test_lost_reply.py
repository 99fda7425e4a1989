"""Scenario 3: a reply is lost. The command ran in Redis, the daemon never learned it:
an XREADGROUP's entries sit pending for it, or a step's events are stored. The daemon
compares its pending entries with the jobs it holds and picks up the strays; a resent
step is recognised as its own; failed acks are retried."""

from __future__ import annotations

import time

import pytest

from batchd.daemon.chaos.proxy import proxy_to
from batchd.producers.keys import CONSUMER_GROUP
from faults.checks import KEYS, assert_all_done_once, fake_jobs
from support.daemon_harness import FakeGenerator, enqueue, fast_settings, wait_until, worker_thread
from support.redis_server import RedisServer


def test_entries_read_for_the_daemon_but_never_seen_are_picked_up(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    settings = fast_settings(redis_server.url, intake_buffer=0)
    settings.engine.max_num_seqs = 1
    busy = {"id": "busy", "prompt_token_ids": [3, 4], "max_tokens": 30}
    jobs = fake_jobs(3, prefix="stray")
    with worker_thread(settings, lambda: FakeGenerator(step_delay_s=0.01)) as worker:
        enqueue(client, KEYS, busy)
        wait_until(lambda: "busy" in worker.held, what="the daemon is full")
        for job in jobs:
            enqueue(client, KEYS, job)
        # The daemon's own XREADGROUP whose reply never arrived: same command, same name.
        client.xreadgroup(CONSUMER_GROUP, worker.consumer, {KEYS.queue(): ">"})
        assert_all_done_once(client, jobs)


@pytest.mark.parametrize("interval_ms", [0, 30])
def test_replies_lost_mid_run(redis_server: RedisServer, interval_ms: int) -> None:
    """Replies of reads, steps, finishes and the heartbeat lost at random moments; with
    a publish interval, also those of publishes carrying only urgent jobs."""
    client = redis_server.client()
    jobs = fake_jobs(8, prefix="lost", max_tokens=40)
    with proxy_to(redis_server.port) as proxy:
        settings = fast_settings(proxy.url, publish_interval_ms=interval_ms)
        with worker_thread(settings, lambda: FakeGenerator(max_running=4, step_delay_s=0.01)):
            for job in jobs:
                enqueue(client, KEYS, job)
            wait_until(lambda: client.xlen(KEYS.events("lost0")) >= 2, what="first tokens")
            for _ in range(12):
                proxy.lose_next_reply()
                time.sleep(0.07)
            assert_all_done_once(client, jobs)
