"""The key layout on a real Redis Cluster (3 primaries, 3 replicas): a producer used
before the first daemon stored it reads it again once a daemon of 3 partitions did, and
a layout lost under a running daemon (the key lives on one primary, which may lose it
alone: restarted without persistence, an eviction) is stored again, so that clients
started since find the jobs' partitions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchd.daemon.cluster_server import ClusterDeployment, cluster_deployment, has_cluster_cli
from batchd.producers.client import Client
from batchd.producers.errors import JobNotFound
from batchd.producers.keys import Keys
from batchd.producers.schema import FinishReason
from support.daemon_harness import FakeGenerator, wait_until, worker_thread
from support.partitions import PARTITIONS, id_in, partitioned

pytestmark = pytest.mark.skipif(not has_cluster_cli(), reason="needs redis-cli --cluster")

KEYS = Keys("batchd", PARTITIONS, tagged=True)


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[ClusterDeployment]:
    with cluster_deployment(tmp_path / "cluster") as deployment:
        yield deployment


def _submit_every_partition(url: str, tag: str) -> None:
    """One job on each partition, by a client, each run to its end."""
    with Client(url, block_ms=200) as client:
        ids = [id_in(KEYS, k, f"{tag}{k}-") for k in range(PARTITIONS)]
        handles = [client.submit("hi", id=job_id, max_tokens=4) for job_id in ids]
        assert client.keys == KEYS
        for handle in handles:
            assert handle.result(timeout=30).finish_reason is FinishReason.length


def test_the_layout_is_read_until_stored_and_stored_again_when_lost(
    redis_cluster: ClusterDeployment,
) -> None:
    admin = redis_cluster.client()
    with Client(redis_cluster.url, block_ms=200) as early:
        with pytest.raises(JobNotFound):
            early.status("nothing")  # a first use, before any daemon
        assert early.keys == Keys("batchd", 1, tagged=True)
        with worker_thread(partitioned(redis_cluster.url), FakeGenerator):
            ids = [id_in(KEYS, k, f"early{k}-") for k in range(PARTITIONS)]
            handles = [early.submit("hi", id=job_id, max_tokens=4) for job_id in ids]
            for handle in handles:
                assert handle.result(timeout=30).finish_reason is FinishReason.length
            admin.delete(KEYS.layout)
            wait_until(lambda: bool(admin.exists(KEYS.layout)), what="the layout stored again")
            stored: Any = admin.get(KEYS.layout)
            assert orjson.loads(stored) == {"partitions": PARTITIONS}
            _submit_every_partition(redis_cluster.url, "after")
    admin.close()
