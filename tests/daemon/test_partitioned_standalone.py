"""A daemon on one redis-server with queues in 3 partitions (tagged names, several slots):
jobs of every partition run to completion once, cancels reach jobs of every partition,
dead letters go to their entry's partition, and a dead daemon's jobs are claimed from
every partition."""

from __future__ import annotations

import signal
from pathlib import Path

import orjson
import pytest
import redis
from faults.checks import assert_all_done_once, wait_nothing_pending

from batchd.daemon.worker.intake import Intake
from batchd.daemon.worker.loop import Worker
from batchd.daemon.worker.member import Member
from batchd.producers.connection.layout import LayoutMismatch
from batchd.producers.keys import CANCEL_FIELD, CONSUMER_GROUP, JOB_FIELD, Keys, lanes
from batchd.producers.schema import FinishReason, JobState
from support.daemon_harness import (
    DaemonProcess,
    FakeGenerator,
    fast_settings,
    status_of,
    token_ids,
    wait_final,
    wait_until,
    worker_thread,
)
from support.partitions import (
    PARTITIONS,
    id_in,
    partitioned,
    partitioned_config,
    spread,
    submit,
)
from support.redis_server import RedisServer

KEYS = Keys("batchd", PARTITIONS)


def test_jobs_of_every_partition_complete_once(redis_server: RedisServer) -> None:
    client = redis_server.client()
    jobs = spread(12, "part", KEYS)
    with worker_thread(partitioned(redis_server.url), FakeGenerator) as worker:
        assert worker.keys == KEYS
        for job in jobs:
            submit(client, KEYS, job)
        assert_all_done_once(client, jobs, keys=KEYS)
    assert orjson.loads(client.get(KEYS.layout)) == {"partitions": PARTITIONS}
    assert not client.exists("batchd:queue:default")  # the untagged name is not used


def test_a_priority_lane_is_read_before_every_partition(redis_server: RedisServer) -> None:
    client = redis_server.client()
    member = Member(client, KEYS, "reader")
    queues = lanes(["default"])
    member.create_groups(queues)
    low = spread(6, "low", KEYS)
    high = spread(6, "high", KEYS, priority=5)
    for job in low:
        submit(client, KEYS, job)
    for job in high:
        submit(client, KEYS, job, queue="default.priority")
    intake = Intake(member, queues)
    intake.read(client, count=10, block_ms=None)
    read = intake.take()
    assert [d.queue for d in read] == ["default.priority"] * 6 + ["default"] * 6
    assert {d.partition for d in read} == set(range(PARTITIONS))
    for delivery in read:  # each knows the stream it came from
        stream = member.stream(delivery)
        assert client.xrange(stream, delivery.entry_id, delivery.entry_id)


def test_a_read_takes_no_more_than_the_room_across_partitions(redis_server: RedisServer) -> None:
    client = redis_server.client()
    member = Member(client, KEYS, "reader")
    member.create_groups(["default"])
    for job in spread(12, "many", KEYS):
        submit(client, KEYS, job)
    intake = Intake(member, ["default"])
    intake.read(client, count=3, block_ms=None)
    read = intake.take()
    assert len(read) == 3 and {d.partition for d in read} == set(range(PARTITIONS))
    assert intake.backlog  # more is waiting: the next publish comes sooner


def test_cancels_reach_jobs_of_every_partition(redis_server: RedisServer) -> None:
    client = redis_server.client()
    jobs = spread(6, "cx", KEYS, max_tokens=4000)
    with worker_thread(partitioned(redis_server.url), lambda: FakeGenerator(step_delay_s=0.01)):
        for job in jobs:
            submit(client, KEYS, job)
        ids = [job["id"] for job in jobs]
        wait_until(
            lambda: all(client.xlen(KEYS.events(i)) >= 3 for i in ids), timeout=30, what="tokens"
        )
        for job_id in ids:  # what Client.cancel does: the truth, then the hint
            client.hset(KEYS.job(job_id), "cancel_requested", "1")
            client.xadd(KEYS.cancel_for(job_id), {CANCEL_FIELD: job_id})
        done = wait_final(client, KEYS, ids, timeout=30)
    assert {done[i][-1].finish_reason for i in ids} == {FinishReason.cancelled}
    assert {KEYS.cancel_for(i) for i in ids} == set(KEYS.cancel_streams())


def test_dead_letters_go_to_the_entry_s_partition(redis_server: RedisServer) -> None:
    client = redis_server.client()
    bad, stray = id_in(KEYS, 2, "bad"), id_in(KEYS, 0, "stray")
    good = spread(3, "ok", KEYS)
    with worker_thread(partitioned(redis_server.url), FakeGenerator):
        submit(client, KEYS, {"id": bad, "prompt_token_ids": [1], "max_tokens": -1})
        # An entry filed in a partition its id does not name: dead-lettered there, and the
        # job's own keys (in partition 0) are never written.
        misfiled = {"id": stray, "prompt_token_ids": [1], "max_tokens": 3}
        client.xadd(KEYS.queue("default", 1), {JOB_FIELD: orjson.dumps(misfiled)})
        for job in good:
            submit(client, KEYS, job)
        assert_all_done_once(client, good, keys=KEYS)
        wait_until(lambda: client.xlen(KEYS.dead_stream(1)) == 1, what="misfiled dead letter")
        wait_until(lambda: client.xlen(KEYS.dead_stream(2)) == 1, what="bad job's dead letter")
    assert status_of(client, KEYS, bad).state is JobState.failed
    letter = client.xrange(KEYS.dead_stream(1))[0][1]
    assert letter[b"id"] == stray.encode() and b"partition 0" in letter[b"error"]
    assert client.xlen(KEYS.dead_stream(0)) == 0
    assert not client.exists(KEYS.job(stray), KEYS.events(stray))


def test_a_dead_daemon_s_jobs_are_claimed_from_every_partition(redis_server: RedisServer) -> None:
    client = redis_server.client()
    jobs = spread(9, "orphan", KEYS)
    settings = partitioned(redis_server.url)
    with worker_thread(settings, FakeGenerator, consumer="first"):
        pass  # creates the groups and the layout
    for job in jobs:
        submit(client, KEYS, job)
    # A daemon that read every partition and died (no heartbeat key).
    for stream in KEYS.queue_partitions("default"):
        client.xreadgroup(CONSUMER_GROUP, "ghost", {stream: ">"})
    assert sum(client.xpending(s, CONSUMER_GROUP)["pending"] for s in KEYS.queue_partitions()) == 9
    with worker_thread(settings, FakeGenerator, consumer="heir"):
        assert_all_done_once(client, jobs, keys=KEYS)
    assert {status_of(client, KEYS, j["id"]).daemon for j in jobs} == {"heir"}


def test_a_daemon_configured_with_other_partitions_refuses(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.set(KEYS.layout, orjson.dumps({"partitions": PARTITIONS}))
    worker = Worker(fast_settings(redis_server.url), FakeGenerator(), consumer="odd")
    with pytest.raises(LayoutMismatch, match="queue.partitions is 1 .* 3 partition"):
        worker.run()
    assert not client.exists(Keys().daemon("odd"))
    assert not client.exists(Keys().queue())
    with pytest.raises(redis.ResponseError):  # no group was created
        client.xinfo_groups(Keys().queue())


@pytest.mark.slow
def test_a_killed_serve_s_jobs_are_resumed_by_another_from_every_partition(
    redis_server: RedisServer, tmp_path: Path, tiny_model: Path
) -> None:
    client = redis_server.client()
    config = partitioned_config(tmp_path, redis_server.url)
    jobs = [
        {"id": id_in(KEYS, i % PARTITIONS, f"kill{i}-"), "prompt_token_ids": [5 + i, 6, 7]}
        for i in range(6)
    ]
    for job in jobs:
        job.update(max_tokens=60, ignore_eos=True)
    first = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "first.log")
    first.wait_serving()
    for job in jobs:
        submit(client, KEYS, job)
    ids = [job["id"] for job in jobs]
    wait_until(lambda: all(client.xlen(KEYS.events(i)) >= 3 for i in ids), timeout=60)
    first.kill()
    cut = {i: client.xlen(KEYS.events(i)) for i in ids}
    assert all(3 <= n < 61 for n in cut.values()), cut
    heir = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "heir.log").wait_serving()
    try:
        twins = [{**job, "id": f"twin-{job['id']}"} for job in jobs]  # uninterrupted runs
        for job in twins:
            submit(client, KEYS, job)
        done = wait_final(client, KEYS, ids + [job["id"] for job in twins], timeout=120)
        wait_nothing_pending(client, keys=KEYS)
    finally:
        heir.signal(signal.SIGTERM)
        assert heir.wait(30) == 0, heir.log_tail()
    for job_id in ids:
        events = done[job_id]
        assert sum(e.final for e in events) == 1 and len(token_ids(events)) == 60
        assert token_ids(events) == token_ids(done[f"twin-{job_id}"]), job_id
