"""The CI smoke run of `batchd chaos`: about 100 jobs, 3 daemon kills, 1 Redis crash,
50 hostile entries and one of each other fault, with the full run's zeros."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchd.daemon.chaos.options import ChaosOptions


def test_smoke_run_loses_doubles_and_breaks_nothing(chaos_run: Callable[..., Any]) -> None:
    options = ChaosOptions(
        jobs=100, kills=3, redis_crashes=1, hostile=50, each_other_fault=1, result_ttl_s=20
    )
    result, table = chaos_run(options, "smoke")
    verdict, ledger = result.verdict, result.ledger
    assert result.keys_left == 0, table
    # An XADD cut off by a fault is not resent (it may exist): it is not counted as sent.
    assert verdict.hostile_sent == verdict.hostile_dead_lettered, table
    assert verdict.hostile_sent + ledger.hostile_unanswered == 50, table
    assert ledger.faults["daemon_kill"] == 3 and ledger.faults["redis_crash"] == 1, table
    assert sum(ledger.faults.values()) == 9, table
    assert ledger.resumes > 0, table
