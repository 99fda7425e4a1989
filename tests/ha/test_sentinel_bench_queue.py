"""`batchd bench --workload queue` on a Sentinel deployment: the daemon it starts, its
client and its Redis figures all go through the ``redis+sentinel://`` URL."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

from batchd.config.settings import load_settings
from batchd.daemon.commands import bench as bench_cmd
from support.sentinel import sentinel_deployment


def test_queue_workload_runs_through_the_sentinel_master(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "--model", str(tiny_model), "--workload", "queue", "--scale", "tiny"]
        + ["--max-num-seqs", "4", "--queue-rounds", "1", "--out", str(out)]
    )
    with sentinel_deployment(tmp_path / "sentinel") as deployment:
        with deployment.master.client() as master:
            commands_before = int(master.info("stats")["total_commands_processed"])
        with contextlib.redirect_stdout(io.StringIO()):
            assert args.func(args, load_settings(redis_url=deployment.url)) == 0
        with deployment.master.client() as master:
            commands_after = int(master.info("stats")["total_commands_processed"])
    queue = json.loads((out / "report.json").read_text())["workloads"]["queue"]
    assert queue["available"], queue.get("reason")
    assert queue["queue"]["finished"] == queue["requests"] > 0
    assert queue["queue"]["redis_cpu_s"] is not None
    # The jobs went through the master the Sentinels name (not a Redis on 6379).
    assert commands_after - commands_before > queue["requests"]
