"""Reads of a partitioned queue a daemon skips: cancel streams of partitions it holds no
job of, and the intake while it is full.

On one redis-server (3 partitions): no read while nothing is held, one XREAD naming only
the held jobs' partitions, and a request made while a partition's stream was not read
(behind thousands of others) still reaches the job once it is held there; a daemon at
capacity (every engine slot and the intake buffer held) sends no XREADGROUP, and a job
queued meanwhile is read once one ends. On a real
Redis Cluster (one partition on each primary): a daemon running jobs of one partition
sends no XREAD to the other primaries, and a cancel reaches a job of another partition
taken later."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from batchd.daemon.cluster_server import ClusterDeployment, cluster_deployment, has_cluster_cli
from batchd.daemon.worker.control import READ_COUNT, Cancellations
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.producers.keys import CANCEL_FIELD, Keys
from batchd.producers.schema import FinishReason
from support.daemon_harness import FakeGenerator, wait_final, wait_until, worker_thread
from support.partitions import PARTITIONS, id_in, partitioned, submit
from support.redis_server import RedisServer

KEYS = Keys("batchd", PARTITIONS)
CLUSTER_KEYS = Keys("batchd", PARTITIONS, tagged=True)


def _publish(cancels: Cancellations, client: redis.Redis) -> list[list[str]]:
    """One publish's read: the streams each queued command names (none: nothing sent)."""
    pipe = client.pipeline(transaction=False)
    cancels.queue(pipe)
    commands = [args for args, _ in pipe.command_stack]
    named = [[str(arg) for arg in args if str(arg).endswith(":cancel")] for args in commands]
    cancels.handle(pipe.execute())
    return named


def _calls(node: redis.Redis, command: str) -> int:
    """How many ``command``s ``node`` has run since its statistics were reset."""
    stats = node.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def _held(job_id: str, partition: int) -> Job:
    return Job(job_id, Delivery("default", "1-0", {}, partition=partition))


def test_a_cancel_made_while_its_partition_was_not_read_reaches_the_job_held_later(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    held: dict[str, Job] = {}
    cancels = Cancellations(KEYS, client, held=held)
    old = id_in(KEYS, 2, "old")
    client.xadd(KEYS.cancel_for(old), {CANCEL_FIELD: old})  # before the start: not read
    cancels.start_at_end(client)
    assert _publish(cancels, client) == []  # nothing held: no read at all
    first = id_in(KEYS, 0, "first")
    held[first] = _held(first, 0)
    assert _publish(cancels, client) == [[KEYS.cancel_stream(0)]]
    # Partition 2 is not read while nothing of it is held; requests pile up there, then
    # one for a job whose pickup found no cancel_requested (made just after that check).
    late = id_in(KEYS, 2, "late")
    for i in range(2 * READ_COUNT + 500):
        client.xadd(KEYS.cancel_stream(2), {CANCEL_FIELD: f"other{i}"})
    client.xadd(KEYS.cancel_for(late), {CANCEL_FIELD: late})
    assert _publish(cancels, client) == [[KEYS.cancel_stream(0)]]
    assert cancels.take() == set()
    held[late] = _held(late, 2)
    requested: set[str] = set()
    for _ in range(3):  # READ_COUNT entries a read: the backlog takes three
        assert _publish(cancels, client) == [[KEYS.cancel_stream(0), KEYS.cancel_stream(2)]]
        requested |= cancels.take()
    assert late in requested and old not in requested
    del held[first], held[late]
    assert _publish(cancels, client) == []


def test_a_daemon_at_capacity_reads_no_queue_entries(redis_server: RedisServer) -> None:
    client = redis_server.client()
    settings = partitioned(redis_server.url, intake_buffer=0)
    settings.engine.max_num_seqs = 2
    running = [{"id": id_in(KEYS, k, f"full{k}-"), "prompt_token_ids": [1]} for k in (0, 1)]
    queued = {"id": id_in(KEYS, 2, "queued"), "prompt_token_ids": [1], "max_tokens": 3}
    for job in running:
        job["max_tokens"] = 4000
    with worker_thread(settings, lambda: FakeGenerator(step_delay_s=0.01)):
        for job in running:
            submit(client, KEYS, job)
        ids = [job["id"] for job in running]
        wait_until(lambda: all(client.xlen(KEYS.events(i)) >= 2 for i in ids), timeout=30)
        client.config_resetstat()
        submit(client, KEYS, queued)
        published = client.xlen(KEYS.events(ids[0]))
        wait_until(lambda: client.xlen(KEYS.events(ids[0])) >= published + 20, timeout=30)
        assert _calls(client, "xreadgroup") == 0  # full: publishes carry no intake read
        assert not client.exists(KEYS.events(queued["id"]))
        client.hset(KEYS.job(ids[0]), "cancel_requested", "1")
        client.xadd(KEYS.cancel_for(ids[0]), {CANCEL_FIELD: ids[0]})
        done = wait_final(client, KEYS, [ids[0], queued["id"]], timeout=30)
        assert _calls(client, "xreadgroup") > 0  # room again: read
        client.hset(KEYS.job(ids[1]), "cancel_requested", "1")
        client.xadd(KEYS.cancel_for(ids[1]), {CANCEL_FIELD: ids[1]})
        wait_final(client, KEYS, [ids[1]], timeout=30)
    assert done[ids[0]][-1].finish_reason is FinishReason.cancelled
    assert done[queued["id"]][-1].finish_reason is FinishReason.length


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterDeployment]:
    with cluster_deployment(tmp_path / "cluster") as deployment:
        yield deployment


@pytest.mark.skipif(not has_cluster_cli(), reason="needs redis-cli --cluster")
def test_on_a_cluster_only_the_primaries_of_held_jobs_are_read_for_cancels(
    cluster: ClusterDeployment,
) -> None:
    client = cluster.client()
    keys = CLUSTER_KEYS
    primaries = [cluster.owner(client.keyslot(keys.cancel_stream(k))) for k in range(PARTITIONS)]
    assert len({p.port for p in primaries}) == PARTITIONS  # one partition on each primary
    busy = [{"id": id_in(keys, 0, f"busy{i}-"), "prompt_token_ids": [1]} for i in range(2)]
    later = {"id": id_in(keys, 2, "later"), "prompt_token_ids": [1]}
    for job in [*busy, later]:
        job["max_tokens"] = 4000
    with worker_thread(partitioned(cluster.url), lambda: FakeGenerator(step_delay_s=0.01)):
        for job in busy:
            submit(client, keys, job)
        ids = [job["id"] for job in busy]
        wait_until(lambda: all(client.xlen(keys.events(i)) >= 2 for i in ids), timeout=30)
        with primaries[2].client() as other:
            other.config_resetstat()
            published = client.xlen(keys.events(ids[0]))
            # Publishes go on (each reads partition 0's cancels), none to this primary.
            wait_until(lambda: client.xlen(keys.events(ids[0])) >= published + 20, timeout=30)
            with primaries[0].client() as own:
                assert _calls(own, "xread") > 0
            assert _calls(other, "xread") == 0
            submit(client, keys, later)
            wait_until(lambda: client.xlen(keys.events(later["id"])) >= 2, timeout=30)
            for job_id in [*ids, later["id"]]:  # what Client.cancel does: truth, then hint
                client.hset(keys.job(job_id), "cancel_requested", "1")
                client.xadd(keys.cancel_for(job_id), {CANCEL_FIELD: job_id})
            done = wait_final(client, keys, [*ids, later["id"]], timeout=30)
            assert _calls(other, "xread") > 0
    assert {events[-1].finish_reason for events in done.values()} == {FinishReason.cancelled}
