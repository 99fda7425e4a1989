"""The test Redis Cluster itself (batchd.daemon.cluster_server): it serves every slot,
a primary's kill promotes its replica with the data it had replicated, the killed node
rejoins as a replica, and slots migrated while a client writes are served by their new
primary with their keys."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from batchd.daemon.cluster_server import ClusterDeployment, cluster_deployment, has_cluster_cli


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDeployment]:
    """One cluster for the module (each test leaves it serving every slot): the tests
    check the tooling, not each other's leftovers."""
    if not has_cluster_cli():
        pytest.skip("redis-cli --cluster not available (needs Redis 5 or later)")
    with cluster_deployment(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


def test_a_cluster_serves_every_slot(redis_cluster: ClusterDeployment) -> None:
    assert len(redis_cluster.primaries()) == 3
    assert redis_cluster.url.startswith("redis+cluster://127.0.0.1:")
    with redis_cluster.client() as client:
        for i in range(50):  # keys over every primary
            client.set(f"key{i}", i)
        assert [int(client.get(f"key{i}") or -1) for i in range(50)] == list(range(50))
        owners = {redis_cluster.owner(key_slot(f"key{i}".encode())).port for i in range(50)}
    assert owners == {p.port for p in redis_cluster.primaries()}


def test_a_killed_primary_is_replaced_by_its_replica_then_rejoins(
    redis_cluster: ClusterDeployment,
) -> None:
    slot = key_slot(b"before")
    with redis_cluster.client() as client:
        client.set("before", "kept")
        with redis_cluster.owner(slot).client() as primary:
            assert primary.execute_command("WAIT", 1, 5000) == 1  # replicated
        replica = redis_cluster.replicas_of(redis_cluster.owner(slot))[0]
        killed = redis_cluster.kill_primary(slot=slot)
        assert redis_cluster.owner(slot) is replica
        assert client.get("before") == b"kept"
        client.set("after", "written")
    redis_cluster.rejoin(killed)
    assert killed not in redis_cluster.primaries()
    assert redis_cluster.replicas_of(replica) == [killed]


def test_migrated_slots_are_served_by_the_target_while_a_client_writes(
    redis_cluster: ClusterDeployment,
) -> None:
    keys = [f"{{tag}}:{i}" for i in range(300)]
    slot = key_slot(keys[0].encode())
    source = redis_cluster.owner(slot)
    target = next(p for p in redis_cluster.primaries() if p is not source)
    written: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def write() -> None:  # keys of the migrating slot, throughout the migration
        with redis_cluster.client() as client:
            n = 0
            while not stop.is_set() and n < 100_000:
                try:
                    client.rpush("{tag}:list", n)
                except redis.RedisError as exc:
                    errors.append(exc)
                    return
                written.append(n)
                n += 1

    with redis_cluster.client() as client:
        for key in keys:
            client.set(key, key)
        writer = threading.Thread(target=write)
        writer.start()
        try:
            moved = redis_cluster.migrate_slots([slot], target)
        finally:
            stop.set()
            writer.join()
        assert not errors
        assert moved >= len(keys)
        assert redis_cluster.owner(slot) is target
        with target.client() as direct:  # the keys live on the target now
            assert direct.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == len(keys) + 1
        assert client.mget(keys) == [key.encode() for key in keys]
        assert [int(v) for v in client.lrange("{tag}:list", 0, -1)] == written
