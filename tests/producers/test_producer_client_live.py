"""The client against a real redis-server and the fake daemon: replay, reconnects, cancel."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batchd.producers import follow
from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client
from batchd.producers.errors import JobFailed, JobNotFound, JobTimeout, ValidationError
from batchd.producers.keys import Keys
from batchd.producers.schema import Event, FinishReason, JobState
from support.daemon_harness import wait_until
from support.redis_server import RedisServer, free_port
from support.text_daemon import expected_text, text_daemon

KEYS = Keys()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Client]:
    with Client(redis_server.url, block_ms=200) as c:
        yield c


def wait_for_events(r: redis.Redis, job_id: str, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while r.xlen(KEYS.events(job_id)) < count:
        assert time.monotonic() < deadline, f"{job_id} has fewer than {count} events"
        time.sleep(0.01)


def assert_complete(events: list[Event], prompt: str, max_tokens: int) -> None:
    """Every seq once, in order, ending with the final event, with the expected text."""
    assert [e.seq for e in events] == list(range(max_tokens + 1))
    assert events[-1].finish_reason is FinishReason.length
    text = expected_text(prompt, max_tokens)
    assert "".join(e.text for e in events[:-1]) == text == events[-1].text


def test_listen_before_submit_and_subscribe_late(
    redis_server: RedisServer, client: Client, redis_client: redis.Redis
) -> None:
    early: list[Event] = []
    listener = threading.Thread(target=lambda: early.extend(client.stream("j1", timeout=20)))
    listener.start()  # listening before the job exists: the id is ours
    with text_daemon(redis_server.url, token_delay_s=0.01):
        handle = client.submit("abcdef", id="j1", max_tokens=40)
        wait_for_events(redis_client, "j1", 15)
        late = list(handle.stream(timeout=20))  # joins mid-generation
        listener.join(timeout=20)
    assert_complete(late, "abcdef", 40)
    assert early == late
    assert handle.result(timeout=1).text == expected_text("abcdef", 40)


# Without redis-py's own retries, the client's reconnect loop does all the work.
NO_RETRY = {"retry": Retry(NoBackoff(), 0)}


@pytest.fixture
def outages(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Connection errors that reached the client's own reconnect loop."""
    seen: list[BaseException] = []
    failed = follow._Outage.failed

    def record(self: follow._Outage, exc: BaseException) -> float:
        seen.append(exc)
        return failed(self, exc)

    monkeypatch.setattr(follow._Outage, "failed", record)
    return seen


def kill_repeatedly(admin: redis.Redis, name: str, stop: threading.Event) -> None:
    """CLIENT KILL every connection called ``name``, again and again, until ``stop``."""
    while not stop.wait(0.1):
        for c in admin.client_list():
            if c["name"] == name:
                admin.client_kill_filter(_id=c["id"])


@pytest.mark.parametrize("options", [{}, NO_RETRY], ids=["redis-py-retry", "own-retry"])
def test_reconnect_after_client_kill_mid_stream(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    options: dict[str, Any],
    outages: list[BaseException],
) -> None:
    victim = redis.Redis.from_url(
        redis_server.url, client_name="victim", socket_timeout=5, **options
    )
    client = Client(victim, block_ms=500)
    stop = threading.Event()
    killer = threading.Thread(target=kill_repeatedly, args=(redis_client, "victim", stop))
    with text_daemon(redis_server.url, token_delay_s=0.02):
        handle = client.submit("xyz", max_tokens=60)
        events = handle.stream(timeout=30)
        seen = [next(events)]
        killer.start()
        seen += list(events)
        stop.set()
        killer.join()
    assert_complete(seen, "xyz", 60)
    assert outages or options is not NO_RETRY
    client.close()


def test_stream_survives_redis_restart(
    redis_server_aof: RedisServer, outages: list[BaseException]
) -> None:
    def restart() -> None:
        redis_server_aof.stop()
        time.sleep(0.3)
        redis_server_aof.start()

    connection = redis.Redis.from_url(redis_server_aof.url, socket_timeout=5, **NO_RETRY)
    seen: list[Event] = []
    with Client(connection, block_ms=200) as client:
        with text_daemon(redis_server_aof.url, token_delay_s=0.01):
            handle = client.submit("restart", max_tokens=50)
            restarter = threading.Thread(target=restart)
            for event in handle.stream(timeout=30):
                seen.append(event)
                if event.seq == 10:
                    restarter.start()
            restarter.join()
    assert_complete(seen, "restart", 50)
    assert outages, "the restart went unnoticed"


def test_cancel_running_and_queued_jobs(redis_server: RedisServer, client: Client) -> None:
    queued = client.submit("never", max_tokens=5)
    assert queued.cancel() is True
    with text_daemon(redis_server.url, token_delay_s=0.01) as daemon:
        running = client.submit("long", max_tokens=1000)
        for event in running.stream(timeout=10):
            if event.seq == 3:
                break
        started = time.monotonic()
        assert running.cancel() is True
        with pytest.raises(JobFailed) as err:
            running.result(timeout=10)
        assert err.value.reason == "cancelled"
        # Ended by the cancel, not by running its course: its 1000 tokens take over 10 s
        # (10 ms each, longer on a loaded host), so the bound leaves room and tells them apart.
        assert time.monotonic() - started < 5
        with pytest.raises(JobFailed, match="cancelled"):
            queued.result(timeout=10)
    status = running.status()
    assert status.state is JobState.cancelled and status.cancel_requested
    assert status.completion_tokens is not None and 3 < status.completion_tokens < 1000
    assert queued.status().state is JobState.cancelled
    assert queued.id not in daemon.started  # cancelled at pickup, never generated
    assert running.cancel() is False


def test_result_timeout(client: Client) -> None:
    handle = client.submit("nobody runs this", max_tokens=4)
    started = time.monotonic()
    with pytest.raises(JobTimeout) as err:
        handle.result(timeout=0.5)
    # Never early; late only by a read's block (200 ms) and a loaded host's delays, where
    # a timeout not kept would wait on until pytest's own.
    assert 0.5 <= time.monotonic() - started < 0.5 + 5
    assert err.value.job_id == handle.id
    assert handle.status().state is JobState.queued


def test_failed_job_raises(redis_server: RedisServer, client: Client) -> None:
    with text_daemon(redis_server.url):
        handle = client.submit("!fail now", max_tokens=4)
        with pytest.raises(JobFailed, match="fake failure") as err:
            handle.result(timeout=10)
    assert err.value.reason == "error"
    assert handle.status().state is JobState.failed


def test_concurrent_submits_of_one_id_enqueue_once(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def submit() -> None:
        with Client(redis_server.url) as c:
            barrier.wait()
            try:
                c.submit("same", id="dup")
                outcomes.append("ok")
            except ValidationError as exc:
                outcomes.append(exc.field)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["id"] * 7 + ["ok"]
    assert redis_client.xlen(KEYS.queue()) == 1


def test_async_client_live(redis_server: RedisServer) -> None:
    async def scenario() -> tuple[list[Event], str]:
        async with AsyncClient(redis_server.url, block_ms=200) as client:
            handle = await client.submit("async", max_tokens=20)
            events = [e async for e in handle.stream(timeout=20)]
            result = await handle.result(timeout=5)
            with pytest.raises(JobTimeout):
                await (await client.submit("late", max_tokens=2, queue="idle")).result(0.3)
            return events, result.text

    with text_daemon(redis_server.url, token_delay_s=0.005):
        events, text = asyncio.run(scenario())
    assert_complete(events, "async", 20)
    assert text == expected_text("async", 20)


def test_a_job_redis_loses_midstream_is_reported_missing_not_waited_for_forever(
    redis_server: RedisServer,
) -> None:
    """Found by `batchd chaos`: Redis crashed and came back without a job whose first
    events a client had already read (its submit was in the unsynced last second); the
    client waited forever for the rest. It now raises JobNotFound like for any job that
    has no status hash for ``missing_timeout_s``."""
    r = redis_server.client()
    with Client(redis_server.url, block_ms=100, missing_timeout_s=0.5) as c:
        c.submit(prompt_token_ids=[1, 2], id="vanishing", max_tokens=5)
        r.xadd(KEYS.events("vanishing"), {"event": Event(seq=0, token_id=7).encode()}, id="0-1")
        stream = c.stream("vanishing", timeout=20)
        assert next(stream).token_id == 7
        r.delete(KEYS.job("vanishing"), KEYS.events("vanishing"))
        started = time.monotonic()
        with pytest.raises(JobNotFound):
            next(stream)
    assert time.monotonic() - started < 10


def test_a_failover_under_a_blocking_read_is_followed_through(redis_server: RedisServer) -> None:
    """Found by `batchd chaos`: a server demoted to replica ends blocked reads with
    UNBLOCKED; the stream raised it to the user instead of reading on."""
    r = redis_server.client()
    events: list[Event] = []
    with Client(redis_server.url, block_ms=2000) as c:
        c.submit(prompt_token_ids=[1, 2], id="failover", max_tokens=2)
        reader = threading.Thread(target=lambda: events.extend(c.stream("failover", timeout=30)))
        reader.start()
        # Caught up: the follower now blocks on XREAD (waited for, not slept on).
        wait_until(lambda: r.info("clients")["blocked_clients"] == 1, what="a blocked read")
        r.replicaof("127.0.0.1", free_port())
        time.sleep(0.3)
        r.replicaof("NO", "ONE")
        stored = [Event(seq=0, token_id=5), Event(seq=1, token_id=6)]
        stored.append(Event(seq=2, finish_reason=FinishReason.length))
        for event in stored:
            r.xadd(KEYS.events("failover"), {"event": event.encode()}, id=f"0-{event.seq + 1}")
        reader.join(30)
    assert [e.seq for e in events] == [0, 1, 2]


def test_error_replies_reach_the_caller_and_leave_nothing_half_done(
    redis_server: RedisServer,
) -> None:
    """On a real redis-server, sync and async alike: a submit refused for memory (OOM under
    noeviction) raises and enqueues nothing, and succeeds once Redis has room again; a
    follower whose user may not XREAD raises NOPERM at once instead of retrying."""
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        with Client(redis_server.url) as c, pytest.raises(redis.ResponseError, match="maxmemory"):
            c.submit(prompt_token_ids=[1, 2], id="full", max_tokens=2)

        async def submit_async() -> None:
            async with AsyncClient(redis_server.url) as ac:
                await ac.submit(prompt_token_ids=[1, 2], id="full", max_tokens=2)

        with pytest.raises(redis.ResponseError, match="maxmemory"):
            asyncio.run(submit_async())
        assert not admin.exists(KEYS.job("full")) and not admin.exists(KEYS.queue("default"))
    finally:
        admin.config_set("maxmemory", 0)
    with Client(redis_server.url) as c:
        c.submit(prompt_token_ids=[1, 2], id="full", max_tokens=2)
    assert admin.xlen(KEYS.queue("default")) == 1
    admin.acl_setuser(
        "blind", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-xread"]
    )
    url = f"redis://blind:pw@127.0.0.1:{redis_server.port}/0"
    with Client(url, block_ms=200) as c, pytest.raises(redis.exceptions.NoPermissionError):
        list(c.stream("full", timeout=5))

    async def follow_async() -> None:
        async with AsyncClient(url, block_ms=200) as ac:
            [e async for e in ac.stream("full", timeout=5)]

    with pytest.raises(redis.exceptions.NoPermissionError):
        asyncio.run(follow_async())


def test_a_read_only_replica_refuses_submit_and_cancel_at_once(redis_server: RedisServer) -> None:
    """A client pointed at a replica (a failover demoted its server) hears READONLY on
    submit and cancel, sync and async, at once and not after retrying; nothing is written,
    and the same calls succeed once the server is a primary again."""
    admin = redis_server.client()
    with Client(redis_server.url) as c:
        c.submit(prompt_token_ids=[1, 2], id="before", max_tokens=2)
    admin.replicaof("127.0.0.1", free_port())  # a primary that is not there: read-only

    async def submit_async() -> None:
        async with AsyncClient(redis_server.url) as ac:
            await ac.submit(prompt_token_ids=[1, 2], id="replica", max_tokens=2)

    try:
        started = time.monotonic()
        with Client(redis_server.url) as c:
            with pytest.raises(redis.exceptions.ReadOnlyError):
                c.submit(prompt_token_ids=[1, 2], id="replica", max_tokens=2)
            with pytest.raises(redis.exceptions.ReadOnlyError):
                c.cancel("before")
        with pytest.raises(redis.exceptions.ReadOnlyError):
            asyncio.run(submit_async())
        assert time.monotonic() - started < 5
        assert not admin.exists(KEYS.job("replica"))
        assert admin.hget(KEYS.job("before"), "cancel_requested") == b"0"
    finally:
        admin.replicaof("NO", "ONE")
    asyncio.run(submit_async())
    with Client(redis_server.url) as c:
        assert c.cancel("before")
    assert admin.xlen(KEYS.queue("default")) == 2
