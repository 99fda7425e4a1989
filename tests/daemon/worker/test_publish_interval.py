"""``daemon.publish_interval_ms``: while busy, the jobs' tokens go to Redis at most that
often, a job's first token and its end at once. Fake engine, real redis-server."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import redis

from batchd.daemon.worker.jobs import Delivery, Job
from batchd.producers.keys import Keys
from batchd.producers.schema import FinishReason
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    expected_fake_tokens,
    fast_settings,
    token_ids,
    wait_final,
    worker_thread,
)
from support.redis_server import RedisServer

KEYS = Keys()
PROMPT = [5, 6, 7]


class StreamLengths:
    """Polls a job's events stream on a thread: every length it was seen at."""

    def __init__(self, client: redis.Redis, job_id: str) -> None:
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(client, job_id), daemon=True)

    def _poll(self, client: redis.Redis, job_id: str) -> None:
        while not self._stop.is_set():
            self.seen.add(int(client.xlen(KEYS.events(job_id))))
            time.sleep(0.002)
        # The length it ended at, which a poll just before the stop may have missed.
        self.seen.add(int(client.xlen(KEYS.events(job_id))))

    def __enter__(self) -> StreamLengths:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_long_interval_sends_the_first_token_at_once_and_the_rest_with_the_end(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    settings = fast_settings(redis_server.url, publish_interval_ms=60_000)
    generator = partial(FakeGenerator, step_delay_s=0.02)
    with worker_thread(settings, generator), StreamLengths(client, "j") as lengths:
        enqueue(client, KEYS, {"id": "j", "prompt_token_ids": PROMPT, "max_tokens": 30})
        events = wait_final(client, KEYS, ["j"])["j"]
    assert token_ids(events) == expected_fake_tokens(PROMPT, None, 30)
    # The first token alone (time to first token), then the other 29 with the final event.
    assert lengths.seen == {0, 1, 31}, sorted(lengths.seen)


@pytest.mark.parametrize(("interval_ms", "at_least", "at_most"), [(0, 30, 41), (200, 3, 14)])
def test_tokens_between_first_and_last_go_out_at_most_every_interval(
    redis_server: RedisServer, interval_ms: int, at_least: int, at_most: int
) -> None:
    """40 steps of 20 ms or more: the stream grows after each step, or about every 200 ms
    (and with the first token and the end; room for slow steps on a loaded machine)."""
    client = redis_server.client()
    settings = fast_settings(redis_server.url, publish_interval_ms=interval_ms)
    generator = partial(FakeGenerator, step_delay_s=0.02)
    with worker_thread(settings, generator), StreamLengths(client, "j") as lengths:
        enqueue(client, KEYS, {"id": "j", "prompt_token_ids": PROMPT, "max_tokens": 40})
        events = wait_final(client, KEYS, ["j"])["j"]
    assert token_ids(events) == expected_fake_tokens(PROMPT, None, 40)
    grew = len(lengths.seen - {0})
    assert at_least <= grew <= at_most, sorted(lengths.seen)


def test_jobs_that_end_often_do_not_hold_back_the_others(redis_server: RedisServer) -> None:
    """Short jobs end every few steps (each end is sent at once, with only the jobs that
    have something urgent): the long job's tokens still go out every interval."""
    client = redis_server.client()
    settings = fast_settings(redis_server.url, publish_interval_ms=150)
    generator = partial(FakeGenerator, step_delay_s=0.02)
    short = [f"s{i}" for i in range(12)]
    with worker_thread(settings, generator), StreamLengths(client, "long") as lengths:
        enqueue(client, KEYS, {"id": "long", "prompt_token_ids": PROMPT, "max_tokens": 60})
        for job_id in short:
            enqueue(client, KEYS, {"id": job_id, "prompt_token_ids": PROMPT, "max_tokens": 3})
            time.sleep(0.06)
        wait_final(client, KEYS, [*short, "long"])
    # 60 steps of 20 ms, a publish of every job each ~150 ms: the long job's stream grew
    # several times between its first token and its end, where a short job's end (sent
    # at once, with the urgent jobs only) restarted nothing.
    assert len(lengths.seen - {0, 1, 61}) >= 3, sorted(lengths.seen)
    assert max(lengths.seen) == 61


def test_urgent_outboxes() -> None:
    job = Job(job_id="j", delivery=Delivery("default", "1-0", {}))
    assert not job.urgent  # nothing to send
    job.add_token(5, "a")
    assert job.urgent  # the first token
    job.unpublished.clear()
    job.stored_events = 1
    job.add_token(6, "b")
    assert not job.urgent  # a token after the first: it can wait for the interval
    job.end(FinishReason.stop)
    assert job.urgent  # the final event
    job.unpublished.clear()
    job.stored_events = 3
    job.status.clear()
    assert job.stored_final and not job.urgent  # the ack alone: see the two tests below


def _pending(client: redis.Redis) -> int:
    return int(client.xpending(KEYS.queue("default"), "batchd")["pending"])


def test_an_ack_waits_for_the_interval_while_nothing_waits_for_its_room(
    redis_server: RedisServer,
) -> None:
    """A short job ends beside a long one: its final event is stored at once, its ack
    (no one waits for the room it frees) with the long job's end, not a publish of its
    own; once the engine is idle everything goes out."""
    client = redis_server.client()
    settings = fast_settings(redis_server.url, publish_interval_ms=60_000)
    generator = partial(FakeGenerator, step_delay_s=0.02)
    with worker_thread(settings, generator):
        # The long job's 300 steps take 6 s at least: it outlasts the short job even on a
        # loaded host, where the short job may be read several steps after it.
        enqueue(client, KEYS, {"id": "long", "prompt_token_ids": PROMPT, "max_tokens": 300})
        enqueue(client, KEYS, {"id": "short", "prompt_token_ids": PROMPT, "max_tokens": 3})
        wait_final(client, KEYS, ["short"])
        time.sleep(0.2)  # ten more steps of the long job
        assert client.xlen(KEYS.events("long")) == 1  # its first token only: still running
        assert _pending(client) == 2  # the short job's ack waits
        wait_final(client, KEYS, ["long"])
        deadline = time.monotonic() + 5
        while _pending(client) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert _pending(client) == 0


def test_an_ack_goes_at_once_while_jobs_wait_for_its_room(redis_server: RedisServer) -> None:
    """Room for two jobs, a long one and four short ones queued: each short job's ack
    (with the read that takes the next one) goes out when it is stored, so the short
    jobs run one after another beside the long one instead of after it."""
    client = redis_server.client()
    settings = fast_settings(redis_server.url, publish_interval_ms=60_000, intake_buffer=0)
    settings.engine.max_num_seqs = 2
    generator = partial(FakeGenerator, step_delay_s=0.02)
    short = [f"s{i}" for i in range(4)]
    with worker_thread(settings, generator):
        enqueue(client, KEYS, {"id": "long", "prompt_token_ids": PROMPT, "max_tokens": 300})
        for job_id in short:
            enqueue(client, KEYS, {"id": job_id, "prompt_token_ids": PROMPT, "max_tokens": 3})
        wait_final(client, KEYS, short)
        # ~4 steps each, 16 of the long job's 300: it is still running.
        assert client.xlen(KEYS.events("long")) == 1
        wait_final(client, KEYS, ["long"])


@pytest.mark.parametrize(("on_cpu", "interval_s"), [(True, 0.1), (False, 0.0)])
def test_unset_the_interval_follows_where_the_engine_computes(
    redis_server: RedisServer, on_cpu: bool, interval_s: float
) -> None:
    """On the CPU each publish stops the engine for its round trip: there tokens between
    the first and the last go out every 100 ms; on a GPU the round trip overlaps the next
    step, and every step is published."""
    settings = fast_settings(redis_server.url)
    assert settings.daemon.publish_interval_ms is None
    with worker_thread(settings, partial(FakeGenerator, steps_use_cpu=on_cpu)) as worker:
        assert worker.cadence.interval_s == interval_s
