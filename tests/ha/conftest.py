"""Fixtures of the high-availability tests: a real Redis Cluster per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from batchd.daemon.cluster_server import ClusterDeployment, cluster_deployment, has_cluster_cli


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[ClusterDeployment]:
    """A ready Redis Cluster of 3 primaries with one replica each, stopped after the test.
    Skipped where ``redis-cli`` has no ``--cluster`` manager (Redis before 5)."""
    if not has_cluster_cli():
        pytest.skip("redis-cli --cluster not available (needs Redis 5 or later)")
    with cluster_deployment(tmp_path / "cluster") as cluster:
        yield cluster
