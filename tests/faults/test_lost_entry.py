"""A job whose status says ``running`` while its queue entry is gone and no daemon holds it:
the state Redis leaves when an AOF ``everysec`` crash took a job's submit while a daemon
ran it (the daemon's next append writes the job's keys again, with no entry behind
them) and that daemon then died. Built here with the real keys on a real redis-server
(AOF on): the submit script's hash and entry, a delivery to a daemon that is gone (no
heartbeat), its status and token events as its appends left them, and the entry then
acked and deleted (or only acked). The sweep (batchd.daemon.fleet.sweep) of the live
daemons must end the job once with a final error event that says why, or re-queue it
when its entry is still in the stream, and give its keys their TTL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from batchd.daemon.fleet.housekeeping import trim_acked
from batchd.daemon.fleet.sweep import LOST_ENTRY_ERROR, Sweep
from batchd.daemon.redis_server import RedisServer
from batchd.daemon.worker.member import Member
from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, EVENT_FIELD, event_id
from batchd.producers.schema import Event, FinishReason, JobState
from faults.checks import KEYS, entry_lost_under_a_daemon
from support.daemon_harness import (
    FakeGenerator,
    events_of,
    expected_fake_tokens,
    fast_settings,
    status_of,
    token_ids,
    wait_final,
    wait_until,
    worker_thread,
)

GONE = "gone-daemon"
PROMPT = [11, 5, 9]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with AOF ``everysec``, as most deployments run it."""
    server = RedisServer(
        tmp_path / "redis", appendonly=True, extra_args=["--appendfsync", "everysec"]
    ).start()
    yield server
    server.kill()


def _held_by_a_dead_daemon(client: redis.Redis, job_id: str, *, tokens: int) -> str:
    """Submit ``job_id``, deliver it to a daemon with no heartbeat, and store what that
    daemon's pickup and appends store: status ``running`` naming it, ``tokens`` token
    events. Returns the entry id (still pending for the dead daemon)."""
    stream = KEYS.queue()
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    Client(client).submit_request(
        {"id": job_id, "prompt_token_ids": PROMPT, "max_tokens": 8}, idempotent=False
    )
    reply: Any = client.xreadgroup(CONSUMER_GROUP, GONE, {stream: ">"}, count=1)
    entry = reply[0][1][0][0].decode()
    client.hset(
        KEYS.job(job_id),
        mapping={
            "state": JobState.running.value,
            "queue": "default",
            "daemon": GONE,
            "entry": entry,
            "epoch": "1",
            "owner": GONE,
            "started_at": "1700000000.0",
        },
    )
    for seq, token in enumerate(expected_fake_tokens(PROMPT, None, tokens)):
        event = Event(seq=seq, token_id=token, text=f"{token} ")
        client.xadd(KEYS.events(job_id), {EVENT_FIELD: event.encode()}, id=event_id(seq))
    return entry


def test_a_running_job_whose_entry_is_gone_ends_once_with_its_reason(server: RedisServer) -> None:
    client = server.client()
    entry = _held_by_a_dead_daemon(client, "lost", tokens=3)
    client.xack(KEYS.queue(), CONSUMER_GROUP, entry)
    client.xdel(KEYS.queue(), entry)
    assert client.ttl(KEYS.job("lost")) == -1  # the state that stayed forever before
    settings = fast_settings(server.url, heartbeat_ttl_s=0.5)
    with (
        worker_thread(settings, FakeGenerator, consumer="a"),
        worker_thread(settings, FakeGenerator, consumer="b"),
    ):
        events = wait_final(client, KEYS, ["lost"], timeout=30)["lost"]
        status = status_of(client, KEYS, "lost")
    final = events[-1]
    assert sum(event.final for event in events) == 1, events
    assert token_ids(events) == expected_fake_tokens(PROMPT, None, 3)
    assert final.finish_reason is FinishReason.error
    assert final.error == LOST_ENTRY_ERROR
    assert final.text == "".join(event.text for event in events[:-1])
    assert status.state is JobState.failed
    assert status.error == LOST_ENTRY_ERROR
    assert status.epoch == 2  # the dead daemon, were it only cut off, is fenced off
    for key in (KEYS.job("lost"), KEYS.events("lost")):
        assert 0 < client.ttl(key) <= settings.result_ttl_s, key


def test_a_running_job_whose_entry_was_acked_is_queued_again_and_resumed(
    server: RedisServer,
) -> None:
    """The state a lost end leaves when the daemon's XACK reached the Redis that came
    back: the entry acked, its job ``running``. Trimming keeps the entry (the only copy
    of the request); the sweep adds it again and a daemon resumes the job from its
    stored events; then the old entry is trimmed."""
    client = server.client()
    entry = _held_by_a_dead_daemon(client, "acked", tokens=3)
    client.xack(KEYS.queue(), CONSUMER_GROUP, entry)
    assert trim_acked(client, KEYS.queue(), keys=KEYS) == 0
    assert client.xlen(KEYS.queue()) == 1
    with worker_thread(fast_settings(server.url), FakeGenerator, consumer="a"):
        events = wait_final(client, KEYS, ["acked"], timeout=30)["acked"]
        status = status_of(client, KEYS, "acked")
        wait_until(lambda: not client.xrange(KEYS.queue(), entry, entry), what="old entry trimmed")
    # Resumed at seq 3 from the stored events: the uninterrupted run's tokens, one end.
    assert token_ids(events) == expected_fake_tokens(PROMPT, None, 8)
    assert sum(event.final for event in events) == 1
    assert events[-1].finish_reason is FinishReason.length
    assert status.state is JobState.finished
    assert client.hget(KEYS.job("acked"), "entry") != entry.encode()
    assert client.ttl(KEYS.job("acked")) > 0


def test_two_sweepers_end_it_once_and_leave_held_jobs_alone(server: RedisServer) -> None:
    """Exactly once with two daemons sweeping at the same moment (and an ended job's keys
    still without a TTL a grace later get one); a job whose daemon is
    alive, or which the sweeping daemon holds itself, is never touched, while one that
    names the sweeping daemon and is not held there is; nothing is done before a
    heartbeat TTL has passed since the job was first found stuck."""
    client = server.client()
    entry = _held_by_a_dead_daemon(client, "lost", tokens=2)
    client.xack(KEYS.queue(), CONSUMER_GROUP, entry)
    client.xdel(KEYS.queue(), entry)
    for job_id, daemon, at in (
        ("alive", "live", "1-1"),
        ("mine", "a", "1-1"),
        ("lapsed", "a", "1-2"),
    ):
        client.hset(
            KEYS.job(job_id),
            mapping={"state": "running", "queue": "default", "daemon": daemon, "entry": at},
        )
    for live in ("live", "a"):
        client.set(KEYS.daemon(live), b"{}")
    # An end whose EXPIREs Redis lost: no TTL on a finished job's keys.
    client.hset(KEYS.job("untimed"), mapping={"state": "finished", "queue": "default"})
    client.xadd(KEYS.events("untimed"), {EVENT_FIELD: b"{}"}, id=event_id(0))
    client.hset(KEYS.job("stateless"), mapping={"epoch": "1", "owner": "gone"})
    sweeps = [
        Sweep(Member(client, KEYS, name), heartbeat_ttl_s=2.0, stall_timeout_s=60, result_ttl_s=99)
        for name in ("a", "b")
    ]
    for sweep in sweeps:
        assert sweep.run(held={"1-1"}, now=100.0) == {"requeued": 0, "ended": 0}
    assert client.hget(KEYS.job("lost"), "state") == b"running"  # within the grace
    assert client.ttl(KEYS.job("untimed")) == -1  # its EXPIREs may still be on the way
    done = [sweep.run(held={"1-1"}, now=102.5) for sweep in sweeps]
    assert sum(d["ended"] for d in done) == 2, done
    for key in (KEYS.job("untimed"), KEYS.events("untimed"), KEYS.job("stateless")):
        assert 0 < client.ttl(key) <= 99, key
    assert [event.final for event in events_of(client, KEYS, "lost")] == [False, False, True]
    assert [event.final for event in events_of(client, KEYS, "lapsed")] == [True]
    for job_id in ("lost", "lapsed"):
        assert client.hget(KEYS.job(job_id), "state") == b"failed"
        assert 0 < client.ttl(KEYS.events(job_id)) <= 99
    for job_id in ("alive", "mine"):
        assert client.hget(KEYS.job(job_id), "state") == b"running", job_id
        assert not client.exists(KEYS.events(job_id))


def test_a_killed_daemons_job_with_its_entry_gone_is_ended_by_the_next_daemon(
    server: RedisServer, tmp_path: Path, tiny_model: Path
) -> None:
    """A real daemon runs a long job; its queue entry disappears under it (what a crash
    that took the submit leaves: the daemon's appends go on, no entry behind them); the
    daemon is SIGKILLed. Nothing pending, nothing to read, ``running`` with no TTL: the
    next daemon's sweep ends it after the tokens stored, once."""
    client = server.client()
    first = entry_lost_under_a_daemon(
        client, tmp_path, redis_url=server.url, model=tiny_model, job_id="orphan"
    )
    first.kill()
    stored = events_of(client, KEYS, "orphan")
    assert client.hget(KEYS.job("orphan"), "state") == b"running"
    assert client.ttl(KEYS.job("orphan")) == -1
    with worker_thread(fast_settings(server.url), FakeGenerator, consumer="next"):
        events = wait_final(client, KEYS, ["orphan"], timeout=30)["orphan"]
    assert events[:-1] == stored
    assert events[-1].finish_reason is FinishReason.error
    assert events[-1].error == LOST_ENTRY_ERROR
    assert status_of(client, KEYS, "orphan").state is JobState.failed
    for key in (KEYS.job("orphan"), KEYS.events("orphan")):
        assert client.ttl(key) > 0, key
