"""Priority over the whole queue: a job with priority > 0 goes to its queue's priority
lane (``<queue>.priority``), which a daemon reads before the queue itself, so it starts
at the next free slot however long the backlog in front of it."""

from __future__ import annotations

import time

import orjson

from batchd.producers.client import Client
from batchd.producers.keys import JOB_FIELD, Keys, lane, lanes
from support.daemon_harness import FakeGenerator, fast_settings, wait_until, worker_thread
from support.redis_server import RedisServer

KEYS = Keys()
BACKLOG = 100_000


def test_lanes_put_priority_first() -> None:
    assert lane("default", 0) == "default" and lane("default", -3) == "default"
    assert lane("default", 1) == "default.priority"
    assert lanes(["a", "b"]) == ["a.priority", "b.priority", "a", "b"]
    assert lane("x" * 128, 5) == "x" * 128  # no valid lane name: the queue itself


def test_a_priority_job_behind_100k_queued_jobs_starts_within_2s(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    payload = orjson.dumps({"prompt_token_ids": [3, 4], "max_tokens": 3})
    for start in range(0, BACKLOG, 10_000):
        with client.pipeline(transaction=False) as pipe:
            for _ in range(start, start + 10_000):
                pipe.xadd(KEYS.queue(), {JOB_FIELD: payload})
            pipe.execute()
    settings = fast_settings(redis_server.url)
    with worker_thread(settings, lambda: FakeGenerator(step_delay_s=0.005)):
        wait_until(lambda: client.exists(KEYS.dead) == 0 and client.xlen(KEYS.queue()) > 0)
        with Client(redis_server.url) as producer:
            time.sleep(0.5)  # the daemon is busy with the backlog, every slot taken
            submitted = time.monotonic()
            handle = producer.submit(prompt_token_ids=[5, 6], max_tokens=2, priority=1_000_000)
            wait_until(
                lambda: client.xlen(KEYS.events(handle.id)) >= 1,
                timeout=2,
                what="the priority job's first token within 2 s",
            )
            started_after = time.monotonic() - submitted
        started = len(client.keys(KEYS.events("x").replace("x", "*")))
        behind = BACKLOG - started  # backlog jobs not started yet
    assert handle.queue == "default.priority"
    assert started_after < 2.0
    assert behind > BACKLOG // 2, "the backlog was really in front of it"
    print(f"priority job started after {started_after * 1000:.0f} ms, {behind} jobs queued")
