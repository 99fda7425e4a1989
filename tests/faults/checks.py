"""What every fault test asserts once the fault is over: each job ended exactly once
with the tokens of an uninterrupted run, and nothing is left pending."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import JobState
from support.daemon_harness import (
    DaemonProcess,
    daemon_config,
    enqueue,
    expected_fake_tokens,
    status_of,
    token_ids,
    wait_final,
    wait_until,
)

KEYS = Keys()


def fake_jobs(n: int, *, prefix: str, max_tokens: int = 30) -> list[dict[str, Any]]:
    """Jobs for the FakeGenerator: odd ones seeded, all deterministic."""
    jobs = []
    for i in range(n):
        job: dict[str, Any] = {
            "id": f"{prefix}{i}",
            "prompt_token_ids": [3 + i, 5, 7 + 2 * i],
            "max_tokens": max_tokens - i % 5,
        }
        if i % 2:
            job.update(temperature=0.7, seed=100 + i)
        jobs.append(job)
    return jobs


def assert_all_done_once(
    client: redis.Redis, jobs: list[dict[str, Any]], *, timeout: float = 60, keys: Keys = KEYS
) -> None:
    """:func:`assert_one_run`, then nothing pending."""
    assert_one_run(client, jobs, timeout=timeout, keys=keys)
    wait_nothing_pending(client, keys=keys)


def assert_one_run(
    client: redis.Redis, jobs: list[dict[str, Any]], *, timeout: float = 60, keys: Keys = KEYS
) -> None:
    """Every job: one final event at the end of a gap-free, duplicate-free stream (checked
    by events_of), the uninterrupted run's tokens, a final status."""
    done = wait_final(client, keys, [job["id"] for job in jobs], timeout=timeout)
    for job in jobs:
        events = done[job["id"]]
        assert sum(e.final for e in events) == 1
        expected = expected_fake_tokens(job["prompt_token_ids"], job.get("seed"), job["max_tokens"])
        assert token_ids(events) == expected, job["id"]
        assert status_of(client, keys, job["id"]).state is JobState.finished


def wait_nothing_pending(client: redis.Redis, *, timeout: float = 20, keys: Keys = KEYS) -> None:
    """No entry pending in any partition of the default queue."""
    from support.daemon_harness import wait_until

    def empty() -> bool:
        streams = keys.queue_partitions()
        return all(int(client.xpending(s, CONSUMER_GROUP)["pending"]) == 0 for s in streams)

    wait_until(empty, timeout=timeout, what="no entry pending")


def entry_lost_under_a_daemon(
    client: redis.Redis, tmp_path: Path, *, redis_url: str, model: Path, job_id: str
) -> DaemonProcess:
    """A ``batchd serve`` process running a 1000-token job ``job_id`` (20 tokens in), whose
    queue entry is then acked and deleted: what a Redis crash that lost the entry leaves
    while the daemon goes on. Returns the daemon (the caller kills or stops it)."""
    config = daemon_config(tmp_path, redis_url)
    job = {"id": job_id, "prompt_token_ids": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
    daemon = DaemonProcess(config, model=model, log_path=tmp_path / "first.log")
    daemon.wait_serving()
    entry = enqueue(client, KEYS, job)
    wait_until(lambda: client.xlen(KEYS.events(job_id)) >= 20, timeout=60, what="tokens")
    client.xack(KEYS.queue(), CONSUMER_GROUP, entry)
    client.xdel(KEYS.queue(), entry)
    return daemon
