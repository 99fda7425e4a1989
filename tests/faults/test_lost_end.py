"""Redis acknowledged a job's end and lost it: AOF ``appendfsync everysec`` on a real
redis-server, killed right after the jobs finished and cut back to the AOF's size a
second earlier (the chaos AOF cut: what a host crash does to ``everysec``). The final
events and statuses are gone, the tokens before them are not, and the daemon had acked
and forgotten the jobs. Its durability watch reads each ended job's status once the
fsync windows have passed, finds them ``running`` and picks them up again: each ends
once more, with the uninterrupted run's tokens, and every key gets its TTL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from batchd.daemon.chaos.aof import AofTail
from batchd.daemon.redis_server import RedisServer
from batchd.producers.client import Client
from batchd.producers.schema import FinishReason
from faults.checks import KEYS, assert_all_done_once, fake_jobs, wait_nothing_pending
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    events_of,
    fast_settings,
    wait_final,
    wait_until,
    worker_thread,
)


@pytest.fixture
def aof(tmp_path: Path) -> Iterator[tuple[RedisServer, AofTail]]:
    """A redis-server with AOF ``everysec`` and the chaos AOF cut's sampler (0.6 s)."""
    server = RedisServer(
        tmp_path / "redis",
        appendonly=True,
        extra_args=["--appendfsync", "everysec", "--aof-load-truncated", "yes"],
    ).start()
    tail = AofTail(server.directory, window_s=0.6).start()
    yield server, tail
    tail.join()
    server.kill()


def test_an_end_redis_lost_after_the_ack_is_found_and_run_again(
    aof: tuple[RedisServer, AofTail],
) -> None:
    server, tail = aof
    client = server.client()
    jobs = fake_jobs(6, prefix="end", max_tokens=60)
    for job in jobs:
        job["max_tokens"] = 60  # all end together, in the last fraction of a second
    settings = fast_settings(server.url)
    with worker_thread(settings, lambda: FakeGenerator(max_running=6, step_delay_s=0.03)):
        for job in jobs:
            enqueue(client, KEYS, job)

        def all_ended() -> bool:
            states = [client.hget(KEYS.job(job["id"]), "state") for job in jobs]
            return all(state == b"finished" for state in states)

        wait_until(all_ended, timeout=30, what="every job ended")
        server.kill()
        cut = tail.cut()
        server.start()
        client = server.client()
        assert cut.dropped_bytes > 0
        states = [client.hget(KEYS.job(job["id"]), "state") for job in jobs]
        # The scenario: some job's tokens were kept and its end was not.
        assert b"running" in states, states
        assert_all_done_once(client, jobs, timeout=30)
        for job in jobs:
            for key in (KEYS.job(job["id"]), KEYS.events(job["id"])):
                assert client.ttl(key) > 0, key


def test_a_lost_cancelled_end_is_written_back_as_its_follower_read_it(
    aof: tuple[RedisServer, AofTail],
) -> None:
    """A job cancelled mid-run; Redis crashes right after its cancelled end and loses the
    last second, the cancel request included. Run again, the job would go on to its
    max_tokens (found by `batchd chaos --seed 3`: its follower read "cancelled", Redis
    later said "finished"). The daemon kept the cancelled end and writes it back."""
    server, tail = aof
    client = server.client()
    job = {"id": "cx", "prompt_token_ids": [4, 5, 6], "max_tokens": 400}
    with worker_thread(
        fast_settings(server.url), lambda: FakeGenerator(max_running=1, step_delay_s=0.03)
    ):
        enqueue(client, KEYS, job)
        # Past the cut's window: the crash keeps the pickup and the first tokens.
        wait_until(lambda: client.xlen(KEYS.events("cx")) >= 50, what="50 tokens")
        Client(client).cancel("cx")
        read = wait_final(client, KEYS, ["cx"], timeout=30)["cx"]
        server.kill()
        assert tail.cut().dropped_bytes > 0
        server.start()
        client = server.client()
        assert client.hget(KEYS.job("cx"), "state") != b"cancelled"  # the end was lost
        wait_until(
            lambda: client.hget(KEYS.job("cx"), "state") == b"cancelled",
            timeout=30,
            what="the cancelled end back",
        )
        wait_nothing_pending(client)
    assert events_of(client, KEYS, "cx") == read
    assert read[-1].finish_reason is FinishReason.cancelled
    for key in (KEYS.job("cx"), KEYS.events("cx")):
        assert client.ttl(key) > 0, key
