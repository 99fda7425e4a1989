"""The publish pipeline's exactly-once guard, on a real redis-server."""

from __future__ import annotations

from typing import Any

import redis

from batchd.daemon.worker.fence import CREATE_ONLY
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.publisher import FlushResult, Publisher
from batchd.producers.keys import CONSUMER_GROUP, EVENT_FIELD, Keys, event_id
from batchd.producers.schema import Event, FinishReason
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    events_of,
    fast_settings,
    wait_final,
    worker_thread,
)
from support.redis_server import RedisServer

KEYS = Keys()


def _job(job_id: str) -> Job:
    return Job(job_id=job_id, delivery=Delivery("default", "1-0", {}))


def test_a_resent_pipeline_is_recognised_as_our_own(redis_server: RedisServer) -> None:
    client = redis_server.client()
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    job = _job("own")
    job.add_token(5, "a")
    job.add_token(6, "b")
    resent = list(job.unpublished)
    assert publisher.flush([job]).published_events == 2
    # The reply was lost (e.g. the connection dropped): the same events go again.
    job.unpublished, job.stored_events = resent, 0
    job.add_token(7, "c")
    result = publisher.flush([job])
    assert result.lost == result.reconcile == [] and job.stored_events == 2
    assert publisher.flush([job]).published_events == 1
    assert [e.token_id for e in events_of(client, KEYS, "own")] == [5, 6, 7]


def test_events_stored_by_another_daemon_mean_the_job_starts_over(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    client.xadd(
        KEYS.events("taken"), {EVENT_FIELD: Event(seq=0, token_id=9).encode()}, id=event_id(0)
    )
    job = _job("taken")
    job.add_token(5, "a")
    result = Publisher(client, KEYS, owner="me", result_ttl_s=60).flush([job])
    assert result.reconcile == [job] and result.lost == []
    assert [e.token_id for e in events_of(client, KEYS, "taken")] == [9]


def _append_after_an_edit(
    client: redis.Redis, job_id: str, *, past_end: bool, status_only: bool = False
) -> tuple[Job, FlushResult]:
    """Store a job's first three events, delete the middle one (and, ``past_end``, add one
    far past the end: the stream's length still says 3), then flush the job's next event
    (or, ``status_only``, a status field alone)."""
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    job = _job(job_id)
    for token in (5, 6, 7):
        job.add_token(token, "t")
    assert publisher.flush([job]).published_events == 3
    events = KEYS.events(job_id)
    assert client.xdel(events, event_id(1)) == 1
    if past_end:
        client.xadd(events, {EVENT_FIELD: Event(seq=8, token_id=9).encode()}, id="0-9")
    if status_only:
        job.set_status(tokens=3)
    else:
        job.add_token(8, "u")
    return job, publisher.flush([job])


def test_a_stream_edited_past_the_owners_end_means_the_job_starts_over(
    redis_server: RedisServer,
) -> None:
    # Judged by the last entry, as a stream another writer extended, not refused.
    client = redis_server.client()
    job, result = _append_after_an_edit(client, "edited", past_end=True)
    assert result.reconcile == [job] and result.refused is None
    job, result = _append_after_an_edit(client, "status", past_end=True, status_only=True)
    assert result.reconcile == [job] and result.refused is None
    assert client.hget(KEYS.job("status"), "tokens") is None


def test_entries_deleted_behind_the_owners_end_do_not_stop_its_appends(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    job, result = _append_after_an_edit(client, "thinned", past_end=False)
    assert result.published_events == 1 and result.reconcile == [] and job.stored_events == 4
    entries: Any = client.xrange(KEYS.events("thinned"))
    assert [entry_id for entry_id, _ in entries] == [b"0-1", b"0-3", b"0-4"]


def test_a_later_pickup_fences_off_the_earlier_owner(redis_server: RedisServer) -> None:
    client = redis_server.client()
    old, new = _job("fenced"), _job("fenced")
    old.add_token(5, "a")
    assert Publisher(client, KEYS, owner="a", result_ttl_s=60).flush([old]).lost == []
    new.epoch, new.stored_events = 2, 1
    new.output_token_ids = [5]
    new.add_token(6, "b")
    assert Publisher(client, KEYS, owner="b", result_ttl_s=60).flush([new]).lost == []
    old.add_token(7, "c")
    assert Publisher(client, KEYS, owner="a", result_ttl_s=60).flush([old]).lost == [old]
    assert [e.token_id for e in events_of(client, KEYS, "fenced")] == [5, 6]


def test_a_step_between_sending_and_settling_keeps_what_it_added(
    redis_server: RedisServer,
) -> None:
    """The pipeline of one step is in flight while the next step adds to the outbox:
    settling removes exactly what was sent, the new events and status stay queued."""
    client = redis_server.client()
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    job = _job("overlap")
    job.add_token(5, "a")
    job.set_status(state="running", note="first")
    flush = publisher.prepare([job])
    assert not isinstance(flush, FlushResult)
    replies = flush.execute()
    job.add_token(6, "b")  # the next step, while the replies are on their way
    job.set_status(note="second")
    result = publisher.settle(flush, replies)
    assert result.published_events == 1 and result.reconcile == []
    assert [e.token_id for e in job.unpublished] == [6] and job.stored_events == 1
    assert job.status == {"note": "second"}  # "state" was stored, "note" changed since
    assert publisher.flush([job]).published_events == 1
    assert [e.token_id for e in events_of(client, KEYS, "overlap")] == [5, 6]
    assert client.hget(KEYS.job("overlap"), "note") == b"second"


def test_an_outbox_rewritten_while_its_pipeline_was_in_flight_starts_over(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    job = _job("rewritten")
    job.add_token(5, "a")
    flush = publisher.prepare([job])
    assert not isinstance(flush, FlushResult)
    replies = flush.execute()
    job.unpublished = [Event(seq=0, token_id=8)]  # no longer the events that were sent
    result = publisher.settle(flush, replies)
    assert result.reconcile == [job] and result.published_events == 0
    assert [e.token_id for e in events_of(client, KEYS, "rewritten")] == [5]


def test_final_event_status_and_ack_in_that_order(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    entry = enqueue(client, KEYS, {"id": "fin", "prompt": "x"})
    client.xreadgroup(CONSUMER_GROUP, "me", {KEYS.queue(): ">"})
    job = Job(job_id="fin", delivery=Delivery("default", entry, {}))
    job.add_token(5, "a")
    job.end(FinishReason.stop)
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    assert publisher.flush([job]).finished == []  # final event and status stored
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 1
    assert publisher.flush([job]).finished == [job]  # then the ack
    assert events_of(client, KEYS, "fin")[-1].finish_reason is FinishReason.stop
    assert client.hget(KEYS.job("fin"), "state") == b"finished"
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0
    assert 0 < client.ttl(KEYS.events("fin")) <= 60


def test_a_lost_consumer_group_is_created_again(redis_server: RedisServer) -> None:
    client = redis_server.client()
    with worker_thread(fast_settings(redis_server.url), FakeGenerator):
        enqueue(client, KEYS, {"id": "before", "prompt": "x", "max_tokens": 3})
        wait_final(client, KEYS, ["before"], timeout=10)
        client.xgroup_destroy(KEYS.queue(), CONSUMER_GROUP)
        enqueue(client, KEYS, {"id": "after", "prompt": "x", "max_tokens": 3})
        done = wait_final(client, KEYS, ["after"], timeout=10)
    assert len(done["after"]) == 4
    assert len(events_of(client, KEYS, "before")) == 4  # re-delivered, repaired, not rerun


def test_a_rejected_entry_resent_after_a_lost_reply_stays_where_it_was_filed(
    redis_server: RedisServer,
) -> None:
    """A bad entry naming a job that appears between pickup and its create-only append is
    found foreign only at the append; the worker must still find it under its filing key."""
    client = redis_server.client()
    client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    entry = client.xadd(KEYS.queue(), {"job": b'{"id": "named", "prompt": 5}'}).decode()
    client.xreadgroup(CONSUMER_GROUP, "me", {KEYS.queue(): ">"})
    job = Job(job_id="named", delivery=Delivery("default", entry, {}))
    job.epoch = CREATE_ONLY
    job.reject("prompt: not a string")
    filed = {job.key: job}
    # A producer's real job of that id lands first.
    real_event = {EVENT_FIELD: Event(seq=0, token_id=9).encode()}
    client.xadd(KEYS.events("named"), real_event, id=event_id(0))
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    flushes = 0
    while not publisher.flush([job]).finished:
        flushes += 1
        assert flushes < 5, job
    assert job.foreign
    del filed[job.key]
    assert [e.token_id for e in events_of(client, KEYS, "named")] == [9]
    assert client.xlen(KEYS.dead) == 1
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0


def test_a_dead_letter_resent_after_a_lost_reply_is_written_once(
    redis_server: RedisServer,
) -> None:
    """Found by `batchd chaos`: Redis paused past the socket timeout ran the buffered
    dead letter and ack after the daemon gave up on the reply; the retry wrote a second
    letter. The letter is now written only while the entry is pending for this daemon."""
    client = redis_server.client()
    client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    entry = client.xadd(KEYS.queue(), {"job": b'{"id": "bad", "prompt": 5}'}).decode()
    client.xreadgroup(CONSUMER_GROUP, "me", {KEYS.queue(): ">"})
    job = Job(job_id="bad", delivery=Delivery("default", entry, {}))
    job.reject("prompt: not a string")
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    while not publisher.flush([job]).finished:
        pass
    job.dead_letter = True  # the reply to the letter and ack was lost: sent again
    assert publisher.flush([job]).finished == [job]
    assert client.xlen(KEYS.dead) == 1
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0


def test_an_entry_another_daemon_claimed_is_dead_lettered_by_that_daemon_only(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    client.xgroup_create(KEYS.queue(), CONSUMER_GROUP, id="0", mkstream=True)
    entry = client.xadd(KEYS.queue(), {"job": b'{"id": "bad2", "prompt": 5}'}).decode()
    client.xreadgroup(CONSUMER_GROUP, "me", {KEYS.queue(): ">"})
    client.xclaim(KEYS.queue(), CONSUMER_GROUP, "other", 0, [entry])
    job = Job(job_id="bad2", delivery=Delivery("default", entry, {}))
    job.reject("prompt: not a string")
    publisher = Publisher(client, KEYS, owner="me", result_ttl_s=60)
    while not publisher.flush([job]).finished:
        pass
    assert client.xlen(KEYS.dead) == 0
    assert client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 1  # the other's


def test_cancelled_ends_wait_only_where_redis_can_lose_an_acknowledged_second(
    redis_server: RedisServer,
) -> None:
    """The publisher reads the server's persistence when it loads its script: AOF
    ``everysec`` holds cancelled ends, ``always`` and no AOF do not, and a CONFIG the
    daemon's user may not run (NOPERM) holds them (the safe side)."""
    from batchd.daemon.worker.publisher import _loses_acknowledged

    admin = redis_server.client()
    assert not _loses_acknowledged(admin)  # no AOF
    admin.config_set("appendonly", "yes")
    admin.config_set("appendfsync", "everysec")
    assert _loses_acknowledged(admin)
    admin.config_set("appendfsync", "always")
    assert not _loses_acknowledged(admin)
    admin.acl_setuser(
        "noconfig", enabled=True, nopass=True, commands=["+@all", "-config"], keys=["*"]
    )
    limited = redis.Redis(host="127.0.0.1", port=redis_server.port, username="noconfig")
    assert _loses_acknowledged(limited)
    limited.close()
