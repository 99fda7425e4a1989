"""The gateway's whole-submit retry: what it waits out, what it never hides, and that a
retried submit names the same job (so a submit whose reply was lost attaches, never
duplicates)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest
import redis

from batchd.producers.aio import AsyncClient
from batchd.producers.gateway.serving.connections import OUTAGE_PAUSE_S, outlast
from batchd.producers.keys import Keys

KEYS = Keys()


class Flaky:
    """Fails with each of ``errors`` in turn, then answers with the call count."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.calls


def test_a_failover_s_errors_are_waited_out() -> None:
    call = Flaky(
        ConnectionResetError("reset by peer"),
        redis.exceptions.ReadOnlyError("READONLY You can't write against a read only replica"),
        redis.ConnectionError("No master found for 'mymaster'"),
    )
    assert asyncio.run(outlast(call, 5.0, "submit")) == 4


def test_a_cluster_changing_hands_is_waited_out() -> None:
    """A slot without a primary yet, a migrating slot, the cluster client's redirections
    used up, a node's pool full: transient on a Redis Cluster."""
    call = Flaky(
        redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
        redis.exceptions.TryAgainError("TRYAGAIN Multiple keys request during rehashing"),
        redis.exceptions.ClusterError("TTL exhausted."),
        redis.exceptions.SlotNotCoveredError("Slot 12 is not covered by the cluster."),
        redis.exceptions.MaxConnectionsError("Too many connections"),
    )
    assert asyncio.run(outlast(call, 5.0, "submit")) == 6


def test_an_outage_longer_than_the_bound_fails_with_its_error() -> None:
    call = Flaky(*[redis.ConnectionError(f"down {i}") for i in range(100)])
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        asyncio.run(outlast(call, 0.5, "submit"))
    # Given up at the 0.5 s bound: the calls are the proof (a loaded host makes fewer,
    # never more). Waiting the 100 errors out would take 100 pauses (20 s): the time
    # bound leaves a loaded host room and still tells them apart.
    assert 2 <= call.calls < 10
    assert time.monotonic() - started < 0.5 + 10 * OUTAGE_PAUSE_S


def test_a_refusal_is_never_retried() -> None:
    call = Flaky(redis.ResponseError("ERR wrong number of arguments"))
    with pytest.raises(redis.ResponseError):
        asyncio.run(outlast(call, 5.0, "submit"))
    assert call.calls == 1


def test_a_submit_whose_reply_was_lost_is_one_job(
    oai: openai.OpenAI, gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first submit reaches Redis and its reply is lost: the gateway's retry attaches
    to the job it made, and the request is answered by that one job."""
    real = AsyncClient.submit_request
    ids: list[str] = []

    async def reply_lost_once(self: AsyncClient, job: Any, **kwargs: Any) -> Any:
        handle = await real(self, job, **kwargs)
        ids.append(handle.id)
        if len(ids) == 1:
            raise redis.ConnectionError("Connection reset by peer (after the write)")
        return handle

    conn = redis.Redis.from_url(gateway.redis_url)
    before = conn.xlen(KEYS.queue())
    monkeypatch.setattr(AsyncClient, "submit_request", reply_lost_once)
    reply = oai.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0)
    assert reply.choices[0].text
    assert len(ids) == 2 and ids[0] == ids[1]
    assert conn.xlen(KEYS.queue()) == before + 1
    conn.close()
