"""Scenarios 7 and 9: the queue stream as others share it. Trimming keeps what another
consumer group has not read or acked; the claim script copes with a pending entry
whose stream entry was deleted (Redis 6.2's XCLAIM returns nil for it; 7.x drops
it from the pending list and returns nothing)."""

from __future__ import annotations

import time
from typing import Any

from batchd.daemon.fleet.housekeeping import trim_acked
from batchd.daemon.fleet.recovery import Recovery
from batchd.daemon.worker.member import Member
from batchd.producers.keys import CONSUMER_GROUP
from faults.checks import KEYS, assert_all_done_once, fake_jobs, wait_nothing_pending
from support.daemon_harness import FakeGenerator, enqueue, fast_settings, worker_thread
from support.redis_server import RedisServer


def test_trimming_keeps_what_another_group_still_needs(redis_server: RedisServer) -> None:
    client = redis_server.client()
    stream = KEYS.queue()
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    client.xgroup_create(stream, "audit", id="0")
    jobs = fake_jobs(4, prefix="audit")
    with worker_thread(fast_settings(redis_server.url), FakeGenerator):
        for job in jobs:
            enqueue(client, KEYS, job)
        assert_all_done_once(client, jobs)
    client.xreadgroup("audit", "auditor", {stream: ">"}, count=2)
    client.xack(stream, "audit", *[e for e, _ in client.xrange(stream, count=1)])
    assert trim_acked(client, stream, keys=KEYS) == 1  # acked by both groups
    assert client.xlen(stream) == 3  # one pending for the auditor, two unread
    client.xreadgroup("audit", "auditor", {stream: ">"})
    assert trim_acked(client, stream, keys=KEYS) == 0
    entries: Any = client.xrange(stream)
    client.xack(stream, "audit", *[e for e, _ in entries])
    assert trim_acked(client, stream, keys=KEYS) == 3 and client.xlen(stream) == 0


def test_claim_copes_with_a_deleted_pending_entry(redis_server: RedisServer) -> None:
    client = redis_server.client()
    stream = KEYS.queue()
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    gone = enqueue(client, KEYS, {"id": "gone", "prompt": "x"})
    kept = enqueue(client, KEYS, {"id": "kept", "prompt": "x"})
    client.xreadgroup(CONSUMER_GROUP, "dead", {stream: ">"})
    client.xdel(stream, gone)
    time.sleep(0.06)
    recovery = Recovery(Member(client, KEYS, "me"), heartbeat_ttl_s=0.05)
    claimed = recovery.claim("default", limit=10)
    assert [d.entry_id for d in claimed] == [kept]
    client.xack(stream, CONSUMER_GROUP, kept)
    wait_nothing_pending(client)
