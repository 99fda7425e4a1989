"""`batchd bench --workload queue` on a Redis Cluster: two daemons on a queue of 3
partitions, the client and the Redis figures all through the ``redis+cluster://`` URL,
every primary doing its share."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.config.settings import load_settings
from batchd.daemon.cluster_server import ClusterDeployment
from batchd.daemon.commands import bench as bench_cmd


def _commands(cluster: ClusterDeployment) -> list[int]:
    """Commands each primary has processed so far."""
    counts = []
    for primary in cluster.primaries():
        with primary.client() as client:
            counts.append(int(client.info("stats")["total_commands_processed"]))
    return counts


@pytest.mark.slow
def test_queue_workload_runs_through_the_cluster(
    tiny_model: Path, tmp_path: Path, redis_cluster: ClusterDeployment
) -> None:
    out = tmp_path / "out"
    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "--model", str(tiny_model), "--workload", "queue", "--scale", "tiny"]
        + ["--max-num-seqs", "4", "--queue-rounds", "1", "--queue-daemons", "2"]
        + ["--out", str(out)]
    )
    settings = load_settings(redis_url=redis_cluster.url, queue={"partitions": 3})
    before = _commands(redis_cluster)
    with contextlib.redirect_stdout(io.StringIO()):
        assert args.func(args, settings) == 0
    spent = [after - b for after, b in zip(_commands(redis_cluster), before, strict=True)]
    queue = json.loads((out / "report.json").read_text())["workloads"]["queue"]
    assert queue["available"], queue.get("reason")
    assert (queue["daemons"], queue["partitions"]) == (2, 3)
    assert queue["queue"]["finished"] == queue["requests"] > 0
    assert queue["queue"]["redis_cpu_s"] is not None
    assert queue["queue"]["submit_jobs_s"] > 0
    # Every primary serves a partition: each took a share of the jobs' commands.
    assert all(n > queue["requests"] for n in spent), spent
