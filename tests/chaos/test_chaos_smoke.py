"""The CI smoke run of `batchd chaos`: about 100 jobs, 3 daemon kills, 1 Redis crash,
50 hostile entries and one of each other fault, with the full run's zeros."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from batchd.daemon.chaos.options import ChaosOptions
from batchd.daemon.chaos.report import render
from batchd.daemon.chaos.run import run_chaos
from batchd.engine import EngineConfig


def test_smoke_run_loses_doubles_and_breaks_nothing(tiny_model: Path, tmp_path: Path) -> None:
    options = ChaosOptions(
        jobs=100, kills=3, redis_crashes=1, hostile=50, each_other_fault=1, result_ttl_s=20
    )
    engine = dataclasses.replace(
        EngineConfig(), max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512
    )
    result = run_chaos(options, model=tiny_model, engine=engine, workdir=tmp_path)
    table = render(result, command="smoke")
    assert result.passed, table
    verdict, ledger = result.verdict, result.ledger
    assert all(count == 0 for count in verdict.zeros().values()), table
    assert result.keys_left == 0, table
    assert verdict.completed + verdict.cancelled_as_asked == 100, table
    # An XADD cut off by a fault is not resent (it may exist): it is not counted as sent.
    assert verdict.hostile_sent == verdict.hostile_dead_lettered, table
    assert verdict.hostile_sent + ledger.hostile_unanswered == 50, table
    assert ledger.faults["daemon_kill"] == 3 and ledger.faults["redis_crash"] == 1, table
    assert sum(ledger.faults.values()) == 9, table
    assert ledger.resumes > 0, table
