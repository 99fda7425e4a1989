"""The clients on a partitioned layout: a plain redis-server laid out in 3 partitions
(tagged names, several hash slots), and a real Redis Cluster, where every script and
XREAD must keep to one slot. Jobs go to their partition, submit_many splits by
partition, cancel, idempotent resubmit, and following jobs across partitions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client, follow
from batchd.producers.errors import ValidationError
from batchd.producers.keys import CANCEL_FIELD, EVENT_FIELD, JOB_FIELD, Keys, event_id
from batchd.producers.schema import Event, FinishReason, JobState, parse_job
from support.partitions import PARTITIONS, Partitioned

IDS = [f"job-{i}" for i in range(24)]


def queued(admin: Any, keys: Keys, queue: str = "default") -> list[list[str]]:
    """The job ids in each partition of ``queue``, in stream order."""
    return [
        [parse_job(fields[JOB_FIELD.encode()]).id or "" for _, fields in admin.xrange(stream)]
        for stream in keys.queue_partitions(queue)
    ]


def finish(admin: Any, keys: Keys, job_id: str, text: str) -> None:
    """What a daemon leaves behind: one event per character, the final one, the status."""
    for seq, char in enumerate(text):
        event = Event(seq=seq, token_id=ord(char), text=char)
        admin.xadd(keys.events(job_id), {EVENT_FIELD: event.encode()}, id=event_id(seq))
    final = Event(seq=len(text), finish_reason=FinishReason.stop, text=text)
    admin.xadd(keys.events(job_id), {EVENT_FIELD: final.encode()}, id=event_id(len(text)))
    admin.hset(keys.job(job_id), "state", JobState.finished.value)


def test_each_job_is_queued_in_its_partition(partitioned: Partitioned) -> None:
    keys, admin = partitioned.keys, partitioned.admin
    with Client(partitioned.url, block_ms=200) as client:
        assert client.keys == keys
        for job_id in IDS:
            assert client.submit("hi", id=job_id).id == job_id
        assert client.status(IDS[0]).state is JobState.queued
    lanes = queued(admin, keys)
    assert all(lanes) and sorted(sum(lanes, [])) == sorted(IDS)
    for k, ids in enumerate(lanes):
        assert ids == [job_id for job_id in IDS if keys.partition(job_id) == k]
    assert admin.exists(keys.job(IDS[0])) and keys.job(IDS[0]).startswith("batchd:{")


def test_submit_many_splits_by_partition_and_keeps_each_ones_order(
    partitioned: Partitioned,
) -> None:
    keys, admin = partitioned.keys, partitioned.admin
    with Client(partitioned.url, block_ms=200) as client:
        handles = client.submit_many([{"prompt": "p", "id": job_id} for job_id in IDS])
        assert [h.id for h in handles] == IDS
        lanes = queued(admin, keys)
        assert [ids for ids in lanes] == [
            [job_id for job_id in IDS if keys.partition(job_id) == k] for k in range(PARTITIONS)
        ]
        # One job taken: the whole call is refused before anything is written.
        fresh = [f"new-{i}" for i in range(9)]
        with pytest.raises(ValidationError, match=f"job {IDS[5]} was already submitted"):
            client.submit_many([{"prompt": "p", "id": job_id} for job_id in [*fresh, IDS[5]]])
        assert queued(admin, keys) == lanes
        assert not any(admin.exists(keys.job(job_id)) for job_id in fresh)
        # Attaching queues the new ones alone.
        again = client.submit_many(
            [{"prompt": "p", "id": job_id} for job_id in [IDS[5], *fresh]], idempotent=True
        )
        assert [h.id for h in again] == [IDS[5], *fresh]
    assert sorted(sum(queued(admin, keys), [])) == sorted(IDS + fresh)


def test_a_clash_found_by_a_later_partition_names_what_was_queued(
    partitioned: Partitioned,
) -> None:
    """A job submitted between the pre-check and its partition's script: that part is
    refused, the parts before it stay queued, and the error says which."""
    keys = partitioned.keys
    ids = ["a-1", "b-2", "c-3", "d-4", "e-5", "f-6"]
    with Client(partitioned.url, block_ms=200) as client:
        call = client.plan_submit_many([{"prompt": "p", "id": i} for i in ids], None, attach=False)
        assert len(call.parts) > 1 and call.checks_first
        late = call.parts[-1].job_ids[0]
        client.submit("first", id=late)
        writes = [(client._submit_many, part.keys, part.args) for part in call.parts]
        replies, _ = client._write(writes)
        with pytest.raises(ValidationError) as caught:
            client.check_submitted_many(call, replies)
    sent = [job_id for part in call.parts[:-1] for job_id in part.job_ids]
    assert f"job {late} was already submitted" in str(caught.value)
    assert str(sent) in str(caught.value)
    assert all(partitioned.admin.exists(keys.job(job_id)) for job_id in sent)


def test_cancel_goes_to_the_jobs_partition(partitioned: Partitioned) -> None:
    keys, admin = partitioned.keys, partitioned.admin
    with Client(partitioned.url, block_ms=200) as client:
        for job_id in IDS[:6]:
            client.submit("hi", id=job_id)
            assert client.cancel(job_id)
    for k in range(PARTITIONS):
        cancelled = [
            f[CANCEL_FIELD.encode()].decode() for _, f in admin.xrange(keys.cancel_stream(k))
        ]
        assert cancelled == [job_id for job_id in IDS[:6] if keys.partition(job_id) == k]
    assert admin.hget(keys.job(IDS[0]), "cancel_requested") == b"1"


def test_an_idempotent_resubmit_attaches(partitioned: Partitioned) -> None:
    keys, admin = partitioned.keys, partitioned.admin
    with Client(partitioned.url, block_ms=200) as client:
        client.submit("hi", id="same")
        with pytest.raises(ValidationError, match="already submitted"):
            client.submit("hi", id="same")
        assert client.submit("hi", id="same", idempotent=True).id == "same"
    assert sum(queued(admin, keys), []) == ["same"]


def test_following_jobs_of_every_partition(partitioned: Partitioned) -> None:
    """One follower over jobs of every partition (on a Cluster: one XREAD per
    partition, then a short block on one at a time): every job's events, none lost."""
    keys, admin = partitioned.keys, partitioned.admin
    ids = IDS[:9]
    assert len({keys.partition(job_id) for job_id in ids}) == PARTITIONS
    with Client(partitioned.url, block_ms=200) as client:
        for job_id in ids:
            finish(admin, keys, job_id, f"t{job_id}")
        assert client.result(ids[0], timeout=10).text == f"t{ids[0]}"
        follower = client.follower(timeout=20)
        assert follower.cluster is partitioned.cluster
        for job_id in ids:
            follower.add(job_id)
        texts: dict[str, str] = {}
        for delivery in follow(client.redis, follower):
            if delivery.event.final:
                texts[delivery.job_id] = delivery.event.text or ""
    assert texts == {job_id: f"t{job_id}" for job_id in ids}


def test_the_async_client_on_partitions(partitioned: Partitioned) -> None:
    keys, admin = partitioned.keys, partitioned.admin

    async def main() -> tuple[list[str], str, bool]:
        async with AsyncClient(partitioned.url, block_ms=200) as client:
            handles = await client.submit_many([{"prompt": "p", "id": i} for i in IDS[:9]])
            one = await client.submit("x", id="solo")
            finish(admin, keys, "solo", "done")
            result = await one.result(timeout=10)
            return [h.id for h in handles], result.text, await client.cancel(IDS[0])

    ids, text, cancelled = asyncio.run(main())
    assert ids == IDS[:9] and text == "done" and cancelled
    assert sorted(sum(queued(admin, keys), [])) == sorted([*IDS[:9], "solo"])
    assert admin.xlen(keys.cancel_for(IDS[0])) == 1


def test_replicas_wait_on_the_primary_that_took_the_submit(partitioned: Partitioned) -> None:
    """WAIT counts the replicas of its own connection's writes: on a Cluster the sync
    client sends it to the primary of each partition's slot; the async one refuses."""
    if not partitioned.cluster:
        pytest.skip("the plain redis-server has no replica")
    with Client(partitioned.url, block_ms=200, replicas=1, replicas_timeout_ms=5000) as client:
        assert client.submit("hi", id="kept").id == "kept"
        assert [h.id for h in client.submit_many([{"prompt": "p", "id": i} for i in IDS])] == IDS
    with pytest.raises(ValueError, match="not supported by the AsyncClient on Redis Cluster"):
        AsyncClient(partitioned.url, replicas=1)
