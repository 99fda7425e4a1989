"""Redis acknowledged a job's end and lost it: AOF ``appendfsync everysec`` on a real
redis-server, killed right after the jobs finished and cut back to the AOF's size a
second earlier (the chaos AOF cut: what a host crash does to ``everysec``). The final
events and statuses are gone, the tokens before them are not, and the daemon had acked
and forgotten the jobs. Its durability watch reads each ended job's status once the
fsync windows have passed, finds them ``running`` and picks them up again: each ends
once more, with the uninterrupted run's tokens, and every key gets its TTL.

When the daemon that ended the job is gone too (stopped while Redis was down, so its
memory went with it, as a kill's does), the rest of the fleet must still end the job
as its follower read it end: the end a follower read stays the job's end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batchd.daemon.chaos.aof import AofTail
from batchd.daemon.redis_server import RedisServer
from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, event_id
from batchd.producers.schema import FinishReason, JobRequest, JobState
from faults.checks import KEYS, assert_all_done_once, fake_jobs, wait_nothing_pending
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    events_of,
    expected_fake_tokens,
    fast_settings,
    status_of,
    token_ids,
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


@dataclass
class _PausedPickup(FakeGenerator):
    """Holds the first pickup between its read of the job's keys and its first append
    (tokenizing waits for ``go``; ``reading`` says it has begun)."""

    reading: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        self.reading.set()
        assert self.go.wait(30)
        return super().encode(job_id, request)


def _crash_and_cut(server: RedisServer, tail: AofTail) -> None:
    server.kill()
    assert tail.cut().dropped_bytes > 0


def test_a_job_whose_submit_then_end_redis_lost_ends_as_its_follower_read_it(
    aof: tuple[RedisServer, AofTail],
) -> None:
    """Redis loses a job's submit (status hash and entry) after daemon "a" read it, and
    later the end "a" wrote; "a" is gone before its durability watch looks. Before the
    fix, "a"'s first append wrote the job's keys again with no entry behind them, and the
    sweep could only end the job ``error`` where its follower had read it finish (`batchd
    chaos` matrix). Now the append finds the entry gone, "a" adds it again, and "b" runs
    the job again from that entry: it ends ``length`` with the tokens the follower read."""
    server, tail = aof
    client = server.client()
    job = {"id": "cut", "prompt_token_ids": [4, 5, 6], "max_tokens": 60}
    settings = fast_settings(server.url)
    reading, go = threading.Event(), threading.Event()
    paused = lambda: _PausedPickup(step_delay_s=0.03, reading=reading, go=go)  # noqa: E731
    with worker_thread(settings, paused, consumer="a"):
        Client(client).submit_request(job)
        assert reading.wait(30)
        # What the crash took: the submit (status hash, entry) and the delivery of it.
        [(entry, _)] = client.xrange(KEYS.queue())
        client.xack(KEYS.queue(), CONSUMER_GROUP, entry)
        client.xdel(KEYS.queue(), entry)
        client.delete(KEYS.job("cut"))
        go.set()
        read = wait_final(client, KEYS, ["cut"], timeout=30)["cut"]
        assert client.hget(KEYS.job("cut"), "entry") != entry  # enqueued again
        _crash_and_cut(server, tail)
    server.start()  # "a" went with Redis down: nothing of it is left to look again
    client = server.client()
    assert client.hget(KEYS.job("cut"), "state") == b"running"  # the end was lost
    with worker_thread(settings, FakeGenerator, consumer="b"):
        events = wait_final(client, KEYS, ["cut"], timeout=30)["cut"]
        wait_until(lambda: client.ttl(KEYS.job("cut")) > 0, what="the status's TTL")
    assert read[-1].finish_reason is events[-1].finish_reason is FinishReason.length
    assert token_ids(events) == token_ids(read) == expected_fake_tokens([4, 5, 6], None, 60)
    assert status_of(client, KEYS, "cut").state is JobState.finished
    assert client.ttl(KEYS.events("cut")) > 0


def test_a_cancelled_end_lost_with_its_daemon_ends_as_its_follower_read_it(
    aof: tuple[RedisServer, AofTail],
) -> None:
    """A job cancelled mid-run; Redis crashes right after the cancelled end reached the
    follower and loses the last second; its daemon is gone with its memory of the end.
    The end was held until the cancel request and the tokens were durable
    (Job.final_held), so the daemon that runs the job again finds the cancel and the
    same tokens and ends it at the same seq, cancelled (before: it ran on to max_tokens
    and ended ``length`` where the follower had read ``cancelled``)."""
    server, tail = aof
    client = server.client()
    job = {"id": "cy", "prompt_token_ids": [4, 5, 6], "max_tokens": 400}
    settings = fast_settings(server.url)
    with worker_thread(settings, lambda: FakeGenerator(max_running=1, step_delay_s=0.03)):
        enqueue(client, KEYS, job)
        wait_until(lambda: client.xlen(KEYS.events("cy")) >= 20, what="20 tokens")
        Client(client).cancel("cy")
        read = wait_final(client, KEYS, ["cy"], timeout=30)["cy"]
        _crash_and_cut(server, tail)
    server.start()
    client = server.client()
    assert client.hget(KEYS.job("cy"), "state") == b"running"  # the end was lost
    with worker_thread(settings, FakeGenerator, consumer="b"):
        events = wait_final(client, KEYS, ["cy"], timeout=30)["cy"]
        wait_nothing_pending(client)
    assert read[-1].finish_reason is events[-1].finish_reason is FinishReason.cancelled
    assert [e.seq for e in events] == [e.seq for e in read]
    assert token_ids(events) == token_ids(read)
    for key in (KEYS.job("cy"), KEYS.events("cy")):
        assert client.ttl(key) > 0, key


def test_a_cancelled_end_whose_tokens_redis_lost_is_written_whole(
    aof: tuple[RedisServer, AofTail],
) -> None:
    """A crash kept the cancel request and took the tokens stored after it, while the
    cancelled end waited to be durable (found by `batchd chaos --seed 23`: the job was
    picked up again, which finds the cancel and ends at once, at the seq Redis kept,
    where its follower had read two tokens more). The daemon still holds the tokens it
    stored lately: it writes them back, then the end, where its follower read it."""
    server, _ = aof
    client = server.client()
    job = {"id": "cz", "prompt_token_ids": [4, 5, 6], "max_tokens": 400}
    settings = fast_settings(server.url)
    make = lambda: FakeGenerator(max_running=1, step_delay_s=0.03)  # noqa: E731
    with worker_thread(settings, make) as worker:
        enqueue(client, KEYS, job)
        wait_until(lambda: client.xlen(KEYS.events("cz")) >= 20, what="20 tokens")
        Client(client).cancel("cz")

        def only_the_end_left() -> bool:
            held = worker.held.get("cz")
            return held is not None and held.final_held() and len(held.unpublished) == 1

        wait_until(only_the_end_left, what="the cancelled end held, its tokens stored")
        read = events_of(client, KEYS, "cz")  # its follower has read these
        # What the crash took: the last three tokens (Redis's stream id goes back too).
        for seq in range(len(read) - 3, len(read)):
            client.xdel(KEYS.events("cz"), event_id(seq))
        client.execute_command("XSETID", KEYS.events("cz"), event_id(len(read) - 4))
        events = wait_final(client, KEYS, ["cz"], timeout=30)["cz"]
    assert events[-1].finish_reason is FinishReason.cancelled
    assert events[:-1] == read
    assert events[-1].seq == len(read)
