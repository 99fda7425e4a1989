"""`batchd chaos` on a Sentinel deployment: a small run with one failover (the master
SIGKILLed, its replica promoted) and a daemon kill, with the full run's zeros."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchd.daemon.chaos.faults import FaultKind
from batchd.daemon.chaos.options import ChaosOptions
from batchd.daemon.chaos.run import fault_counts


def test_failover_run_loses_doubles_and_breaks_nothing(
    ha_chaos_run: Callable[..., Any], tmp_path: Path
) -> None:
    result, _ = ha_chaos_run("sentinel", failovers=1)
    assert result.ledger.faults["failover"] == 1 and result.ledger.faults["daemon_kill"] == 1
    # The master really moved: the run says so, and so do the Sentinels' own logs.
    moved = re.search(r"failover: master :(\d+) -> :(\d+)", "\n".join(result.ledger.fault_log))
    assert moved is not None and moved[1] != moved[2], result.ledger.fault_log
    sentinel_log = (tmp_path / "sentinel" / "sentinel0" / "sentinel.log").read_text()
    assert f"+switch-master mymaster 127.0.0.1 {moved[1]} 127.0.0.1 {moved[2]}" in sentinel_log


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"failovers": 1}, "--failovers needs --deployment sentinel"),
        ({"failovers": -1, "deployment": "sentinel"}, "fault counts must be >= 0"),
        ({"failovers": 2, "deployment": "sentinel"}, None),
    ],
)
def test_failovers_need_a_sentinel_deployment(
    changes: dict[str, object], refused: str | None, assert_refusal: Callable[..., None]
) -> None:
    assert_refusal(changes, refused)


def test_on_sentinel_a_redis_crash_is_a_failover_and_one_address_faults_are_not_run() -> None:
    counts = fault_counts(
        ChaosOptions(deployment="sentinel", failovers=2, redis_crashes=1, each_other_fault=1)
    )
    assert counts[FaultKind.failover] == 3 and counts[FaultKind.redis_crash] == 0
    assert counts[FaultKind.network_partition] == counts[FaultKind.redis_pause] == 0
    assert counts[FaultKind.read_only] == 0
    assert counts[FaultKind.daemon_stop] == counts[FaultKind.refused_writes] == 1
    single = fault_counts(ChaosOptions())
    assert single[FaultKind.failover] == 0 and single[FaultKind.redis_crash] == 2
