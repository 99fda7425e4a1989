"""Priority over the whole queue: a job with priority > 0 goes to its queue's priority
lane (``<queue>.priority``), which a daemon reads before the queue itself, so it starts
at the next free slot however long the backlog in front of it."""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis

from batchd.producers.client import Client
from batchd.producers.keys import JOB_FIELD, Keys, lane, lanes
from support.daemon_harness import (
    FakeGenerator,
    fast_settings,
    status_of,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer

KEYS = Keys()
BACKLOG = 100_000


def test_lanes_put_priority_first() -> None:
    assert lane("default", 0) == "default" and lane("default", -3) == "default"
    assert lane("default", 1) == "default.priority"
    assert lanes(["a", "b"]) == ["a.priority", "b.priority", "a", "b"]
    assert lane("x" * 128, 5) == "x" * 128  # no valid lane name: the queue itself


def test_a_priority_job_behind_100k_queued_jobs_starts_at_the_next_free_slot(
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
    gen = FakeGenerator(step_delay_s=0.005)
    with worker_thread(settings, lambda: gen):
        wait_until(lambda: client.exists(KEYS.dead) == 0 and client.xlen(KEYS.queue()) > 0)
        with Client(redis_server.url) as producer:
            # The daemon is busy with the backlog, every slot taken.
            wait_until(lambda: len(gen.running) == gen.max_running, what="every slot taken")
            submitted_at = time.time()
            handle = producer.submit(prompt_token_ids=[5, 6], max_tokens=2, priority=1_000_000)
            # Behind the backlog it would wait minutes (100k jobs of 3 steps, 8 at a time):
            # the bound only ends a broken run; the order below is the proof.
            wait_until(
                lambda: client.xlen(KEYS.events(handle.id)) >= 1,
                timeout=60,
                what="the priority job's first token",
            )
        started_at = status_of(client, KEYS, handle.id).started_at
        backlog_starts = _backlog_started_at(client, skip=handle.id)
    assert handle.queue == "default.priority"
    assert started_at is not None
    behind = BACKLOG - len(backlog_starts)  # backlog jobs not started yet
    assert behind > BACKLOG // 2, "the backlog was really in front of it"
    # Only jobs the daemon had already read (a slot's worth and its intake buffer) may
    # start between its submit and its start, however slow the host; FIFO would be 50k+.
    overtaking = [at for at in backlog_starts if submitted_at <= at < started_at]
    assert len(overtaking) <= 2 * (gen.max_running + settings.daemon.intake_buffer), (
        f"{len(overtaking)} backlog jobs started between its submit and its start "
        f"({started_at - submitted_at:.3f} s)"
    )


def _backlog_started_at(client: redis.Redis, *, skip: str) -> list[float]:
    """When each started backlog job started (its status hash's started_at)."""
    head = KEYS.job("x")[:-1].encode()  # a status hash is the head and an id, no ":"
    keys = [
        k
        for k in client.scan_iter(match=head + b"*", count=10_000)
        if b":" not in k[len(head) :] and k != KEYS.job(skip).encode()
    ]
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hget(key, "started_at")
        values: list[Any] = pipe.execute()
    return [float(v) for v in values if v is not None]
