"""What the chaos tests share: a small run judged by the full run's zeros, the small
high-availability run the Sentinel and Cluster tests make, and the check that a fault
is refused outside the deployment it needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchd.daemon.chaos.options import ChaosOptions, problem
from batchd.daemon.chaos.report import render
from batchd.daemon.chaos.run import ChaosResult, run_chaos
from batchd.engine import EngineConfig

# A run's jobs and table: what each test asserts on beyond the shared verdict.
ChaosRun = Callable[[ChaosOptions, str], tuple[ChaosResult, str]]

# The engine of every test run: small batches, so the tiny model's runs stay short.
_ENGINE = dataclasses.replace(
    EngineConfig(), max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512
)


@pytest.fixture
def chaos_run(tiny_model: Path, tmp_path: Path) -> ChaosRun:
    """Run ``options`` in the test's tmp_path and assert what every run must show: it
    passed, every zero of the full run is zero, and each job completed or was cancelled
    as asked. Returns the result and its rendered table (``command`` names the run)."""

    def run(options: ChaosOptions, command: str) -> tuple[ChaosResult, str]:
        result = run_chaos(options, model=tiny_model, engine=_ENGINE, workdir=tmp_path)
        table = render(result, command=command)
        assert result.passed, table
        assert all(count == 0 for count in result.verdict.zeros().values()), table
        verdict = result.verdict
        assert verdict.completed + verdict.cancelled_as_asked == options.jobs, table
        return result, table

    return run


@pytest.fixture
def ha_chaos_run(chaos_run: ChaosRun) -> Callable[..., tuple[ChaosResult, str]]:
    """A small run on ``deployment`` (sentinel or cluster): 30 jobs, 2 daemons, one
    daemon kill, 10 hostile entries, no other fault but the deployment's own, given as
    ``faults`` (``failovers=1``; ``primary_kills=1, migrations=1``)."""

    def run(deployment: str, **faults: int) -> tuple[ChaosResult, str]:
        options = ChaosOptions(jobs=30, daemons=2, kills=1, redis_crashes=0, hostile=10)
        options = dataclasses.replace(
            options, each_other_fault=0, result_ttl_s=10, deployment=deployment, **faults
        )
        return chaos_run(options, f"{deployment} smoke")

    return run


@pytest.fixture
def assert_refusal() -> Callable[[dict[str, Any], str | None], None]:
    """Assert that the default options with ``changes`` are refused with a problem that
    says ``refused``, or (``refused`` None) accepted."""

    def check(changes: dict[str, Any], refused: str | None) -> None:
        found = problem(dataclasses.replace(ChaosOptions(), **changes))
        assert (found is None) if refused is None else (found is not None and refused in found)

    return check
