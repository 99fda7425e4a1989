"""Scenario 2: Redis loses recent writes while the daemon survives (a restart from an
older RDB snapshot). The daemon notices at its next write for each job (the events
stream does not end where it believes), starts the job over from what Redis holds,
and every job ends with the uninterrupted run's tokens, never gapped or mixed."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from batchd.producers.schema import FinishReason
from faults.checks import KEYS, assert_all_done_once, entry_lost_under_a_daemon, fake_jobs
from support.daemon_harness import (
    DaemonProcess,
    FakeGenerator,
    daemon_config,
    enqueue,
    fast_settings,
    token_ids,
    wait_final,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer


def test_restart_from_an_older_snapshot(redis_server: RedisServer) -> None:
    client = redis_server.client()
    jobs = fake_jobs(6, prefix="rdb", max_tokens=60)
    settings = fast_settings(redis_server.url)
    with worker_thread(settings, lambda: FakeGenerator(max_running=3, step_delay_s=0.01)):
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(lambda: client.xlen(KEYS.events("rdb0")) >= 5, what="first tokens")
        client.save()  # the snapshot Redis will come back with
        wait_until(lambda: client.xlen(KEYS.events("rdb0")) >= 30, what="more tokens")
        redis_server.kill()  # what came after the snapshot is lost
        time.sleep(0.3)
        redis_server.start()
        assert_all_done_once(client, jobs)


def test_failover_to_an_empty_replica_loses_the_queue_too(redis_server: RedisServer) -> None:
    """Everything is lost (a replica that never synced took over): the jobs the daemon
    holds are enqueued again from its memory and complete from seq 0."""
    client = redis_server.client()
    jobs = fake_jobs(3, prefix="gone", max_tokens=40)
    with worker_thread(
        fast_settings(redis_server.url), lambda: FakeGenerator(max_running=3, step_delay_s=0.01)
    ):
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(lambda: client.xlen(KEYS.events("gone0")) >= 5, what="first tokens")
        client.flushall()
        assert_all_done_once(client, jobs)


def test_a_job_whose_entry_redis_lost_survives_the_death_of_its_daemon(
    redis_server: RedisServer, tmp_path: Path, tiny_model: Path
) -> None:
    """Found by `batchd chaos`: Redis lost a job's queue entry (its last second) while a
    daemon held the job; the daemon ran it again from memory, recreating its status,
    then died: the job stayed `running` with no pending entry, for no daemon to resume.
    Now the entry is enqueued again from memory when the loss is noticed."""
    client = redis_server.client()
    # What a crash losing the last second leaves: no entry, a shorter events stream.
    first = entry_lost_under_a_daemon(
        client, tmp_path, redis_url=redis_server.url, model=tiny_model, job_id="orphan"
    )
    stored: Any = client.xrange(KEYS.events("orphan"))
    with client.pipeline() as rollback:  # the stream as it was 5 events in
        rollback.delete(KEYS.events("orphan"))
        for entry_id, fields in stored[:5]:
            rollback.xadd(KEYS.events("orphan"), fields, id=entry_id)
        rollback.execute()
    wait_until(
        lambda: b"enqueued again" in (tmp_path / "first.log").read_bytes(),
        timeout=30,
        what="the entry enqueued again",
    )
    first.kill()
    config = daemon_config(tmp_path, redis_server.url)
    second = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "second.log")
    try:
        done = wait_final(client, KEYS, ["orphan"], timeout=120)["orphan"]
    finally:
        second.signal(signal.SIGTERM)
        second.wait(30)
    assert done[-1].finish_reason is FinishReason.length
    assert len(token_ids(done)) == 1000
    assert b"orphan started" in (tmp_path / "second.log").read_bytes()  # not the first's
