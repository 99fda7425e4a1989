"""Issue 50's acceptance on Redis Cluster: the slot of a queue partition with a job
running in it is migrated to another primary while jobs are submitted and generated;
for the migration's span the slot's keys are on both nodes (clients follow ``ASK`` and
retry ``TRYAGAIN``). Every job completes exactly once, with a one-run stream holding the
tokens of an uninterrupted run, and nothing is left pending (checks:
tests/ha/cluster_run.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cluster_run import KEYS, cluster_daemon, job_slot, run_across

from batchd.daemon.cluster_server import ClusterDeployment

# Two keys per MIGRATE, a pause between: the slot stays half moved for seconds.
BATCH = 2
PAUSE_S = 0.1


@pytest.mark.parametrize("jobs", [10, pytest.param(40, marks=pytest.mark.slow)])
def test_jobs_across_a_slot_migration_complete_once(
    tmp_path: Path, tiny_model: Path, redis_cluster: ClusterDeployment, jobs: int
) -> None:
    seen: dict[str, Any] = {}

    def migrate_a_running_jobs_slot(running: list[str]) -> None:
        every = [f"ha{i}" for i in range(jobs)]  # the producer's ids
        with redis_cluster.client() as conn:
            # The slot of the running job with the most left to generate (the fewest
            # events stored): the likeliest to be written while the slot moves.
            slot = job_slot(min(running, key=lambda job_id: int(conn.xlen(KEYS.events(job_id)))))
            source = redis_cluster.owner(slot)
            target = next(p for p in redis_cluster.primaries() if p is not source)
            seen["before"] = _events_in(conn, every, slot)
            seen["moved"] = redis_cluster.migrate_slots(
                [slot], target, batch=BATCH, pause_s=PAUSE_S
            )
        seen.update(slot=slot, target=target, every=every)

    with cluster_daemon(tmp_path, redis_cluster, tiny_model) as daemon:
        run_across(redis_cluster, daemon, jobs, migrate_a_running_jobs_slot)
    assert redis_cluster.owner(seen["slot"]) is seen["target"]
    assert seen["moved"] > 0
    # Tokens went to the slot once it began to move (while it moved, where a write's keys
    # were all on one side, or once it had: a multi-key write over both sides waits with
    # TRYAGAIN), so jobs did run across the move.
    with redis_cluster.client() as conn:
        written = _events_in(conn, seen["every"], seen["slot"]) - seen["before"]
    assert written > 0, "no token was written to the slot after it began to move"


def _events_in(conn: Any, job_ids: list[str], slot: int) -> int:
    """How many events the jobs of ``slot`` among ``job_ids`` have stored."""
    return sum(int(conn.xlen(KEYS.events(j))) for j in job_ids if job_slot(j) == slot)
