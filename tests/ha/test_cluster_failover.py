"""Issue 50's acceptance on Redis Cluster: a primary is SIGKILLed while jobs are
submitted and generated on a queue of 3 partitions, its replica is promoted, and the
daemon and the producer (submitting, following) carry on without a restart. Every job
completes exactly once, with a one-run stream holding the tokens of an uninterrupted run,
and nothing is left pending (checks: tests/ha/cluster_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_run import cluster_daemon, job_slot, run_across

from batchd.daemon.cluster_server import ClusterDeployment
from batchd.daemon.redis_server import RedisServer


@pytest.mark.parametrize("jobs", [10, pytest.param(40, marks=pytest.mark.slow)])
def test_jobs_across_a_primary_kill_complete_once(
    tmp_path: Path, tiny_model: Path, redis_cluster: ClusterDeployment, jobs: int
) -> None:
    killed: list[tuple[RedisServer, RedisServer, int]] = []

    def kill_a_running_jobs_primary(running: list[str]) -> None:
        slot = job_slot(running[0])
        primary = redis_cluster.owner(slot)
        replica = redis_cluster.replicas_of(primary)[0]
        redis_cluster.kill_primary(slot=slot)
        killed.append((primary, replica, slot))

    with cluster_daemon(tmp_path, redis_cluster, tiny_model) as daemon:
        run_across(redis_cluster, daemon, jobs, kill_a_running_jobs_primary)
    (primary, replica, slot), *_ = killed
    assert primary.proc is None and redis_cluster.owner(slot) is replica
