"""A daemon on a real Redis Cluster (3 primaries, 3 replicas) serving a queue of 3
partitions, one on each primary: it starts, claims a dead daemon's jobs from every
partition, runs new jobs to completion once, publishes tokens on sharded channels,
cancels and dead-letters per partition, and carries on across a primary's failover (the
promoted replica has no scripts: the daemon loads them again)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from faults.checks import assert_all_done_once, assert_one_run, wait_nothing_pending

from batchd.daemon.cluster_server import ClusterDeployment, cluster_deployment, has_cluster_cli
from batchd.daemon.worker.fence import APPEND_SHARDED
from batchd.daemon.worker.member import Member
from batchd.producers.keys import CANCEL_FIELD, CONSUMER_GROUP, Keys
from batchd.producers.schema import Event, FinishReason, JobState
from support.daemon_harness import (
    FakeGenerator,
    status_of,
    wait_final,
    wait_until,
    worker_thread,
)
from support.partitions import (
    id_in,
    partitioned,
    spread,
    submit,
)

pytestmark = pytest.mark.skipif(not has_cluster_cli(), reason="needs redis-cli --cluster")

KEYS = Keys("batchd", 3, tagged=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterDeployment]:
    with cluster_deployment(tmp_path / "cluster") as deployment:
        yield deployment


def test_a_daemon_serves_a_partitioned_queue_on_a_cluster(cluster: ClusterDeployment) -> None:
    client = cluster.client()
    owners = {cluster.owner(client.keyslot(s)).port for s in KEYS.queue_partitions()}
    assert len(owners) == 3  # one partition on each primary
    settings = partitioned(cluster.url)
    orphans = spread(6, "orphan", KEYS)
    Member(client, KEYS, "ghost").create_groups(["default.priority", "default"])
    for job in orphans:
        submit(client, KEYS, job)
    for stream in KEYS.queue_partitions():  # a daemon that read every partition and died
        client.xreadgroup(CONSUMER_GROUP, "ghost", {stream: ">"})
    fresh = spread(6, "fresh", KEYS)
    long = spread(3, "long", KEYS, max_tokens=4000)
    bad = id_in(KEYS, 2, "bad")
    shard = client.pubsub()
    shard.ssubscribe(KEYS.tokens(fresh[1]["id"]))
    with worker_thread(settings, lambda: FakeGenerator(step_delay_s=0.005)) as worker:
        assert worker.keys == KEYS
        for job in fresh + long:
            submit(client, KEYS, job)
        submit(client, KEYS, {"id": bad, "prompt_token_ids": [1], "max_tokens": -1})
        assert_one_run(client, orphans + fresh, keys=KEYS)
        ids = [job["id"] for job in long]
        for job_id in ids:
            client.hset(KEYS.job(job_id), "cancel_requested", "1")
            client.xadd(KEYS.cancel_for(job_id), {CANCEL_FIELD: job_id})
        ended = wait_final(client, KEYS, ids, timeout=60)
        wait_until(lambda: client.xlen(KEYS.dead_stream(2)) == 1, what="dead letter")
        wait_nothing_pending(client, keys=KEYS)
    assert {ended[i][-1].finish_reason for i in ids} == {FinishReason.cancelled}
    assert {status_of(client, KEYS, j["id"]).daemon for j in orphans} == {worker.consumer}
    assert status_of(client, KEYS, bad).state is JobState.failed
    assert orjson.loads(client.get(KEYS.layout)) == {"partitions": 3}
    published = []
    while (message := shard.get_sharded_message(timeout=0.5)) is not None:
        if message["type"] == "smessage":
            published.append(Event.decode(message["data"]).seq)
    shard.close()
    assert published and published == sorted(published) and published[-1] >= 1


@pytest.mark.slow
def test_a_daemon_carries_on_across_a_primary_failover(cluster: ClusterDeployment) -> None:
    client = cluster.client()
    jobs = spread(6, "fo", KEYS, max_tokens=150)  # all running, still after the failover
    with worker_thread(partitioned(cluster.url), lambda: FakeGenerator(step_delay_s=0.05)):
        for job in jobs:
            submit(client, KEYS, job)
        ids = [job["id"] for job in jobs]
        wait_until(lambda: all(client.xlen(KEYS.events(i)) >= 2 for i in ids), timeout=30)
        assert not any(status_of(client, KEYS, i).state.terminal for i in ids)
        slot = client.keyslot(KEYS.queue("default", 1))
        killed = cluster.kill_primary(slot=slot)
        promoted = cluster.owner(slot)
        assert promoted.port != killed.port
        assert_all_done_once(client, jobs, keys=KEYS)
    # The promoted replica started without scripts; the daemon loaded them there again.
    sha = hashlib.sha1(APPEND_SHARDED.encode()).hexdigest()
    assert promoted.client().script_exists(sha) == [True]
