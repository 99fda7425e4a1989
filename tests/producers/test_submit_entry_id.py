"""A submitted job's status hash names its queue entry (``entry``), written by the
submit script with the entry: the sync client, the async client and submit_many, on a
real redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import redis

from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client
from batchd.producers.keys import ENTRY_FIELD, JOB_FIELD, Keys
from support.redis_server import RedisServer

KEYS = Keys()


def _entries(conn: redis.Redis, queue: str = "default") -> dict[str, str]:
    """Job id -> the id of its entry on the queue stream."""
    found: Any = conn.xrange(KEYS.queue(queue))
    return {
        orjson.loads(fields[JOB_FIELD.encode()])["id"]: entry.decode() for entry, fields in found
    }


def _named(conn: redis.Redis, job_id: str) -> str | None:
    value: Any = conn.hget(KEYS.job(job_id), ENTRY_FIELD)
    return value.decode() if value is not None else None


def test_every_submit_path_stores_the_entry_id_with_the_entry(redis_server: RedisServer) -> None:
    conn = redis_server.client()
    with Client(redis_server.url) as client:
        one = client.submit("one", max_tokens=2).id
        many = [h.id for h in client.submit_many([{"prompt": f"m{i}"} for i in range(3)])]
        again = client.submit_request({"id": one, "prompt": "one"}, idempotent=True).id

    async def submit_async() -> str:
        async with AsyncClient(redis_server.url) as aclient:
            return (await aclient.submit_request({"prompt": "async"})).id

    late = asyncio.run(submit_async())
    entries = _entries(conn)
    assert len(entries) == 5  # the idempotent retry added no entry
    for job_id in [one, *many, late]:
        assert _named(conn, job_id) == entries[job_id]
    assert again == one and _named(conn, one) == entries[one]


def test_a_refused_entry_leaves_no_hash_to_name_it(redis_server: RedisServer) -> None:
    conn = redis_server.client()
    conn.set(KEYS.queue("taken"), "not a stream")
    with Client(redis_server.url) as client, pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        client.submit_request({"id": "refused", "prompt": "x"}, queue="taken")
    assert not conn.exists(KEYS.job("refused"))
