"""A late write to a job whose keys are gone makes no key, on a real redis-server.

Found while looking into keys a `batchd chaos --deployment cluster` run left after the
result TTLs: a daemon's append to a job whose keys had expired, or whose keys a killed
primary took while the job's queue entry stayed (a bare entry's job gets its keys from
the daemon, after the entry), made the status hash again with no TTL before finding the
events stream short (batchd.daemon.worker.fence). Only the sweep gave it one, seconds
later; and only while a daemon ran.
"""

from __future__ import annotations

import redis

from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.publisher import Publisher
from batchd.producers.keys import CONSUMER_GROUP, Keys
from support.daemon_harness import enqueue
from support.redis_server import RedisServer

KEYS = Keys()


def _read(client: redis.Redis, job_id: str) -> Job:
    """Job ``job_id`` from a bare queue entry, as a pickup of consumer ``a`` holds it."""
    if not client.exists(KEYS.queue()):
        client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    entry = enqueue(client, KEYS, {"id": job_id, "prompt": "x", "max_tokens": 8})
    client.xreadgroup(CONSUMER_GROUP, "a", {KEYS.queue(): ">"})
    job = Job(job_id=job_id, delivery=Delivery("default", entry, {}))
    job.from_queue = True
    return job


def test_a_late_append_to_a_job_whose_keys_are_gone_creates_none(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    job = _read(client, "gone")
    job.epoch = 2  # a later pickup's: its first append claims the job
    job.add_token(5, "a")
    job.add_token(6, "b")
    job.stored(2)  # stored once, in keys Redis no longer holds
    job.add_token(7, "c")
    result = Publisher(client, KEYS, owner="a", result_ttl_s=60).flush([job])
    assert result.reconcile == [job]  # picked up again from what Redis holds
    assert client.exists(KEYS.job("gone"), KEYS.events("gone")) == 0


def test_an_append_that_finds_the_stream_moved_still_fences_off_earlier_holders(
    redis_server: RedisServer,
) -> None:
    """Where the status hash exists, the claim is written even though the append writes
    no event: the holder it took the job from can write no more."""
    client = redis_server.client()
    earlier = _read(client, "moved")
    earlier.add_token(5, "a")
    assert Publisher(client, KEYS, owner="a", result_ttl_s=60).flush([earlier]).reconcile == []
    later = Job(job_id="moved", delivery=earlier.delivery)
    later.from_queue = True
    later.epoch = 2
    later.add_token(9, "z")  # believes the stream empty: it holds one event
    assert Publisher(client, KEYS, owner="b", result_ttl_s=60).flush([later]).reconcile == [later]
    assert client.hmget(KEYS.job("moved"), "epoch", "owner") == [b"2", b"b"]
    earlier.add_token(6, "b")
    assert Publisher(client, KEYS, owner="a", result_ttl_s=60).flush([earlier]).lost == [earlier]
