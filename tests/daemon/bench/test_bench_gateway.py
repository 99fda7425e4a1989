"""`batchd bench --workload gateway` end to end at a tiny size: the report, not its speed.

The command runs as a user runs it, in a process of its own that starts its own
redis-server, daemon and gateway. Benchmarks never pass or fail on figures (timings
drift with the machine's load); this checks that every request and stream succeeded,
that Redis came back and the gateway with it, and that report.json, report.md and the
headline all say so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchd.daemon.bench.gateway.load import SCENARIOS

REQUESTS, BURST, STREAMS, OUTAGE_S, AFTER_S = 20, 10, 20, 0.5, 2.0


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("gateway-bench")
    command = [sys.executable, "-m", "batchd.daemon.cli", "bench", "--workload", "gateway"]
    command += ["--gateway-requests", str(REQUESTS), "--gateway-burst", str(BURST)]
    command += ["--gateway-streams", str(STREAMS), "--gateway-outage-s", str(OUTAGE_S)]
    command += ["--gateway-after-s", str(AFTER_S), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=out)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "report.json").read_text()), out, done.stdout


def test_every_request_of_every_scenario_succeeds(
    bench_run: tuple[dict[str, Any], Path, str],
) -> None:
    report, _, _ = bench_run
    results = report["workloads"]["gateway"]
    assert list(results) == list(SCENARIOS)
    sizes = {"rps16": REQUESTS, "rps256": REQUESTS, "burst": BURST, "sse": STREAMS}
    for name, size in sizes.items():
        figures = results[name]
        assert figures["statuses"] == {"200": size}, (name, figures)
        assert figures["errors"] == [], (name, figures)
        assert figures["requests_per_s"] > 0, (name, figures)
        assert 0 < figures["p50_ms"] <= figures["p99_ms"], (name, figures)
    assert results["rps16"]["concurrency"] == 16 and results["rps256"]["concurrency"] == 256


def test_every_stream_gets_every_token(bench_run: tuple[dict[str, Any], Path, str]) -> None:
    sse = bench_run[0]["workloads"]["gateway"]["sse"]
    assert sse["streams_complete"] == STREAMS, sse
    assert sse["ttft_p50_ms"] is not None and sse["ttft_p50_ms"] <= sse["p50_ms"], sse


def test_the_gateway_recovers_from_a_redis_restart(
    bench_run: tuple[dict[str, Any], Path, str],
) -> None:
    back = bench_run[0]["workloads"]["gateway"]["restart"]
    assert back["outage_s"] >= OUTAGE_S, back
    assert back["requests_after_redis_up"] > 0, back
    assert back["failed_after_redis_up"] == 0, back
    assert back["statuses_after_up"] == {"200": back["requests_after_redis_up"]}, back
    assert back["ready_after_up_s"] is not None and back["ready_after_up_s"] < AFTER_S, back


def test_the_report_names_its_settings_table_and_headline(
    bench_run: tuple[dict[str, Any], Path, str],
) -> None:
    report, out, stdout = bench_run
    settings = report["settings"]
    assert (settings["requests"], settings["burst"], settings["streams"]) == (
        REQUESTS,
        BURST,
        STREAMS,
    )
    assert settings["command"].startswith("batchd bench --workload gateway --model tiny")
    assert report["machine"]["cpu_count"] >= 1
    table = (out / "report.md").read_text()
    assert f"| {REQUESTS} requests, 256 in flight |" in table
    assert f"{STREAMS} of {STREAMS} streams complete" in table
    assert "Redis stopped and restarted" in table and report["headline"] in table
    assert stdout.splitlines()[-1] == report["headline"]
    assert f"{STREAMS}/{STREAMS} SSE streams complete" in report["headline"]
