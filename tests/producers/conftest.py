"""Fixtures shared by the producers' tests: a private redis-server per module (the
gateway's and the dashboard's), and a partitioned deployment (a plain redis-server laid
out in 3 partitions, or a real Redis Cluster) for the layout-aware tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from batchd.daemon.cluster_server import ClusterDeployment, cluster_deployment, has_cluster_cli
from batchd.producers.connection import claim_layout
from batchd.producers.keys import DEFAULT_PREFIX
from support.partitions import PARTITIONS, Partitioned
from support.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server for one test module (its daemon and server share it)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.kill()


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDeployment]:
    """One Redis Cluster (3 primaries, 3 replicas) for a test module; tests flush it."""
    if not has_cluster_cli():
        pytest.skip("redis-cli --cluster not available (needs Redis 5 or later)")
    with cluster_deployment(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(params=["standalone", "cluster"])
def partitioned(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Partitioned]:
    """A plain redis-server and a Redis Cluster, each with the layout of PARTITIONS
    partitions claimed (as a daemon configured so would), empty."""
    if request.param == "standalone":
        server = RedisServer(tmp_path / "redis").start()
        admin: Any = server.client()
        try:
            keys = claim_layout(admin, DEFAULT_PREFIX, PARTITIONS)
            yield Partitioned("standalone", server.url, admin, keys)
        finally:
            admin.close()
            server.kill()
        return
    cluster: ClusterDeployment = request.getfixturevalue("module_cluster")
    admin = cluster.client()
    admin.flushall(target_nodes=RedisCluster.PRIMARIES)
    try:
        keys = claim_layout(admin, DEFAULT_PREFIX, PARTITIONS)
        yield Partitioned("cluster", cluster.url, admin, keys)
    finally:
        admin.close()
