"""What the high-availability acceptance tests check once their fault is over (a
Sentinel failover, a Redis Cluster primary's kill or slot migration): every job
completed exactly once, with a one-run stream, delivered and stored, holding the tokens
an uninterrupted run gives, and nothing left pending in any queue stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import Event, JobState
from support.daemon_harness import events_of, status_of, token_ids, wait_final


def mid_run(conn: redis.Redis, keys: Keys, job_ids: list[str]) -> list[str]:
    """Jobs whose stored stream has tokens and no final event yet."""
    running = []
    for job_id in job_ids:
        last: Any = conn.xrevrange(keys.events(job_id), count=1)
        if last and not Event.decode(last[0][1][b"event"]).final:
            running.append(job_id)
    return running


def uninterrupted(
    client: Client, jobs: int, request: Callable[[int, str], dict[str, Any]]
) -> dict[str, list[int]]:
    """The tokens of an uninterrupted run of jobs ``ha0``.. (``request(i, prefix)``):
    the same requests again under ids ``ref<i>``, run one after the other after the fault."""
    reference = {}
    for i in range(jobs):
        job = request(i, "ref")
        client.submit_request(job)
        reference[f"ha{i}"] = token_ids(list(client.stream(job["id"], timeout=60)))
    return reference


def assert_each_job_once(
    conn: redis.Redis,
    keys: Keys,
    delivered: dict[str, list[Event]],
    reference: dict[str, list[int]],
    *,
    queues: list[str],
) -> None:
    """Every job of ``delivered`` (job id -> the events its follower was given) ended once,
    as :mod:`this module <ha_checks>` says; ``queues``: the streams to find nothing pending in."""
    job_ids = list(delivered)
    stored = wait_final(conn, keys, job_ids, timeout=30)
    for job_id in job_ids:
        given = delivered[job_id]
        assert [e.seq for e in given] == list(range(len(given))), job_id
        assert sum(e.final for e in given) == 1 and given[-1].final, job_id
        events = events_of(conn, keys, job_id)  # checks seq 0..n-1, final last
        assert events == stored[job_id]
        assert sum(e.final for e in events) == 1, job_id
        assert token_ids(events) == token_ids(given) == reference[job_id], job_id
        assert status_of(conn, keys, job_id).state is JobState.finished, job_id
    for stream in queues:
        pending: Any = conn.xpending(stream, CONSUMER_GROUP)
        assert int(pending["pending"]) == 0, (stream, pending)
