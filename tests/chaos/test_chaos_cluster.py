"""`batchd chaos` on a Redis Cluster: a small run on a queue of 3 partitions with a
primary kill (its replica promoted, the old one back as a replica), a live migration of a
partition's slot and a daemon kill, with the full run's zeros; the faults a cluster
cannot take are not run, and the cluster faults are refused elsewhere."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from batchd.daemon.chaos.faults import NOT_ON_CLUSTER, FaultKind
from batchd.daemon.chaos.options import ChaosOptions
from batchd.daemon.chaos.run import fault_counts
from batchd.daemon.cluster_server import has_cluster_cli


@pytest.mark.skipif(not has_cluster_cli(), reason="redis-cli --cluster not available")
def test_cluster_run_loses_doubles_and_breaks_nothing(ha_chaos_run: Callable[..., Any]) -> None:
    result, _ = ha_chaos_run("cluster", primary_kills=1, migrations=1)
    faults = result.ledger.faults
    assert (faults["primary_kill"], faults["migration"], faults["daemon_kill"]) == (1, 1, 1)
    log = "\n".join(result.ledger.fault_log)
    killed = re.search(r"primary_kill: slot \d+: primary :(\d+) -> :(\d+)", log)
    assert killed is not None and killed[1] != killed[2], log
    moved = re.search(r"migration: slot \d+: (\d+) keys :(\d+) -> :(\d+)", log)
    assert moved is not None and int(moved[1]) > 0 and moved[2] != moved[3], log


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"primary_kills": 1}, "--primary-kills and --migrations need --deployment cluster"),
        ({"migrations": 1, "deployment": "sentinel"}, "need --deployment cluster"),
        ({"migrations": -1, "deployment": "cluster"}, "fault counts must be >= 0"),
        ({"primary_kills": 2, "migrations": 2, "deployment": "cluster"}, None),
    ],
)
def test_cluster_faults_need_a_cluster_deployment(
    changes: dict[str, object], refused: str | None, assert_refusal: Callable[..., None]
) -> None:
    assert_refusal(changes, refused)


def test_on_a_cluster_the_faults_it_cannot_take_are_not_run() -> None:
    counts = fault_counts(
        ChaosOptions(deployment="cluster", primary_kills=2, migrations=3, redis_crashes=1)
    )
    assert counts[FaultKind.primary_kill] == 2 and counts[FaultKind.migration] == 3
    assert all(counts[kind] == 0 for kind in NOT_ON_CLUSTER)
    assert counts[FaultKind.failover] == 0
    assert counts[FaultKind.daemon_stop] == counts[FaultKind.refused_writes] == 1
    # Elsewhere, no cluster fault is scheduled (the seeded schedules stay as they were).
    single = fault_counts(ChaosOptions())
    assert single[FaultKind.primary_kill] == single[FaultKind.migration] == 0
