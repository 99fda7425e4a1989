"""`batchd bench` end to end on the tiny model: the report's shape, not its speed.

Benchmarks report, they never pass or fail on figures (timings drift too much): this
only checks that every system ran every request to max_tokens and that the
report, table, chart and headline are all there.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.config.settings import load_settings
from batchd.daemon.bench.subscriber import SUBSCRIBER_NICE
from batchd.daemon.bench.workloads import SCALES, mixed, shared_prefix
from batchd.daemon.commands import bench as bench_cmd
from support.redis_server import RedisServer

# Static batching runs on mixed only (batchd.daemon.bench.runner.OFFLINE_SYSTEMS).
OFFLINE_SYSTEMS = {
    "mixed": {"batchd", "batchgen", "static", "sequential"},
    "shared-prefix": {"batchd", "batchgen", "sequential"},
}
TINY_VOCAB = 1024


@dataclass(frozen=True)
class BenchRun:
    report: dict[str, Any]
    out: Path
    stdout: str


@pytest.fixture(scope="module")
def bench_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchRun]:
    """One tiny-scale run of every workload, shared by the checks below."""
    out = tmp_path_factory.mktemp("bench-out")
    server = RedisServer(tmp_path_factory.mktemp("bench-redis")).start()
    stdout = io.StringIO()
    try:
        # The bench subcommand alone, as batchd.daemon.cli registers it.
        parser = argparse.ArgumentParser(prog="batchd")
        bench_cmd.register(parser.add_subparsers())
        args = parser.parse_args(
            ["bench", "--model", str(tiny_model), "--scale", "tiny", "--max-num-seqs", "4"]
            + ["--queue-rounds", "2", "--out", str(out)]
        )
        with contextlib.redirect_stdout(stdout):
            assert args.func(args, load_settings(redis_url=server.url)) == 0
    finally:
        server.kill()
    yield BenchRun(json.loads((out / "report.json").read_text()), out, stdout.getvalue())


def test_settings_and_machine_are_recorded(bench_run: BenchRun) -> None:
    report = bench_run.report
    assert report["settings"]["max_num_seqs"] == 4
    assert report["settings"]["scale"] == "tiny"
    assert report["settings"]["command"].startswith("batchd bench --workload all --model ")
    assert report["settings"]["command"].endswith(" --queue-rounds 2")
    # Online runs batchd with the latency setting; the throughput workloads with the engine's.
    assert report["settings"]["online_max_prefill_tokens_with_decodes"] == 4
    assert report["settings"]["max_prefill_tokens_with_decodes"] is None
    assert report["settings"]["prefill_fills_row_tile"] is True
    assert "prefill_fills_row_tile on" in (bench_run.out / "report.md").read_text()
    assert "--online-max-prefill-tokens 4" in report["settings"]["command"]
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["mlx"] and machine["blas"]
    if sys.platform.startswith("linux"):
        assert machine["cpu"] and machine["cpu"] in (bench_run.out / "report.md").read_text()
    assert report["limit"]["matmul_gflops"] > 0
    for name in ("mixed", "shared-prefix"):
        assert report["workloads"][name]["limit"]["matmul_gflops"] > 0
    assert report["limit"]["mflop_per_output_token"] > report["limit"]["mflop_per_prompt_token"]


@pytest.mark.parametrize("name", ["mixed", "shared-prefix"])
def test_offline_workloads_run_every_system_to_max_tokens(bench_run: BenchRun, name: str) -> None:
    result = bench_run.report["workloads"][name]
    build = mixed if name == "mixed" else shared_prefix
    workload = build(scale=SCALES["tiny"], vocab_size=TINY_VOCAB, seed=0)
    assert result["output_tokens"] == workload.output_tokens
    assert set(result["systems"]) == OFFLINE_SYSTEMS[name], result["unavailable"]
    for key, figures in result["systems"].items():
        runs = {
            "sequential": SCALES["tiny"].sequential_requests,
            "static": SCALES["tiny"].short_requests,
        }
        expected = workload.subset(runs.get(key, len(workload.requests)))
        assert figures["finished"] == figures["requests"] == len(expected.requests), key
        assert figures["output_tokens"] == expected.output_tokens, key
        assert figures["tok_s"] > 0 and figures["wall_s"] > 0, key
        assert 0 < figures["mfu"] < 1, key
        assert len(figures["ttft_s"]) == figures["requests"], key
    assert set(result["ratios"]) == {f"vs_{key}" for key in OFFLINE_SYSTEMS[name] - {"batchd"}}
    assert all(r > 0 for r in result["ratios"].values())
    assert result["limit"]["limit_tok_s"] > result["systems"]["batchd"]["tok_s"]


def test_online_compares_latency_at_the_same_arrivals(bench_run: BenchRun) -> None:
    online = bench_run.report["workloads"]["online"]
    assert online["rate_req_s"] > 0
    assert set(online["systems"]) == {"batchd", "batchgen"}, online["unavailable"]
    for figures in online["systems"].values():
        assert figures["finished"] == online["requests"]
        assert figures["ttft_p99_s"] >= figures["ttft_p50_s"] > 0
        assert figures["itl_p99_s"] >= figures["itl_p50_s"] > 0
    assert set(online["ratios"]) == {"ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"}
    # batchd reports its own steps (none of the warm-up's); BatchGenerator has none to report.
    steps = online["systems"]["batchd"]["engine_steps"]
    assert steps["steps"] > 0 and steps["step_p99_s"] >= steps["step_p50_s"] > 0
    assert "engine_steps" not in online["systems"]["batchgen"]
    assert steps["same_batch_steps"] > 0 and steps["same_batch_decodes"] > 0
    assert steps["same_batch_p99_s"] >= steps["same_batch_p50_s"] > 0
    report = (bench_run.out / "report.md").read_text()
    assert "batchd's engine steps" in report and "the commonest batch" in report


def test_queue_runs_through_a_daemon_against_in_process(bench_run: BenchRun) -> None:
    queue = bench_run.report["workloads"]["queue"]
    assert queue["available"], queue.get("reason")
    assert queue["ratio"] > 0 and queue["reference_tok_s"] > 0
    assert queue["queue"]["subscriber_cpu_s"] >= 0
    if sys.platform.startswith("linux"):  # the client ran as the daemon's clients do
        assert queue["queue"]["subscriber_nice"] == SUBSCRIBER_NICE
    # Every token went through Redis's scripts: its CPU time shows them.
    assert queue["queue"]["redis_cpu_s"] > 0
    # Read from the daemon's metrics: it published every token and stepped the engine.
    run = queue["queue"]
    assert run["daemon_publishes"] >= 1 and 0 < run["daemon_publish_s"]
    assert run["daemon_step_s"] > 0
    assert "of its engine-step time publishing" in (bench_run.out / "report.md").read_text()
    assert len(queue["rounds"]) == 2  # as --queue-rounds asked
    for key in ("queue", "in_process", "in_process_after"):
        assert queue[key]["finished"] == queue["requests"], key
    tokens = {queue[k]["output_tokens"] for k in ("queue", "in_process", "in_process_after")}
    assert len(tokens) == 1 and tokens.pop() > 0


def test_files_and_headline(bench_run: BenchRun) -> None:
    assert (bench_run.out / "report.png").read_bytes().startswith(b"\x89PNG")
    table = (bench_run.out / "report.md").read_text()
    assert "| mixed | batchd |" in table and "| shared-prefix | FLOP limit" in table
    last_line = bench_run.stdout.strip().splitlines()[-1]
    assert last_line == bench_run.report["headline"]
    assert last_line.startswith("mixed ") and "x BatchGenerator" in last_line


def test_online_sweep_runs_every_bound_in_alternating_rounds(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`batchd bench --workload online-sweep`: every setting in every round, BatchGenerator
    once a round, the table in report.md, the options in the recorded command."""
    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    out = tmp_path / "out"
    args = parser.parse_args(
        ["bench", "--model", str(tiny_model), "--scale", "tiny", "--max-num-seqs", "4"]
        + ["--workload", "online-sweep", "--sweep-bounds", "4,none", "--sweep-rounds", "2"]
        + ["--out", str(out)]
    )
    with contextlib.redirect_stdout(io.StringIO()):
        assert args.func(args, load_settings()) == 0
    report = json.loads((out / "report.json").read_text())
    assert "--sweep-bounds 4,none --sweep-rounds 2" in report["settings"]["command"]
    sweep = report["workloads"]["online-sweep"]
    assert sweep["bounds"] == [4, None] and not sweep["unavailable"]
    assert len(sweep["rounds"]) == 2
    for figures in sweep["rounds"]:
        assert set(figures) == {"bound 4", "no bound", "batchgen"}
        for cell in figures.values():
            assert cell["ttft_p99_s"] >= cell["ttft_p50_s"] > 0
            assert cell["itl_spread"] >= 1
        assert "decode_only_spread" in figures["bound 4"]
        assert "decode_only_spread" not in figures["batchgen"]
    table = (out / "report.md").read_text()
    assert "| batchd prefill bound | round 1 | round 2 |" in table
    assert "| bound 4 |" in table and "| mlx-lm BatchGenerator |" in table
    assert "| workload | system |" not in table  # no empty throughput table
    assert "max_prefill_tokens_with_decodes" not in table  # each row names its bound
    worst = max(r["bound 4"]["ttft_p99_s"] for r in sweep["rounds"])
    assert f"bound 4 TTFT p99 {worst:.2f}s ITL " in report["headline"]
    assert report["headline"].startswith("online sweep, worst round: ")
    assert f"**{report['headline']}**" in table


def test_sweep_bounds_must_be_positive_or_none() -> None:
    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        parser.parse_args(["bench", "--sweep-bounds", "16,0"])
    for option in ("--sweep-rounds", "--queue-rounds"):
        with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
            parser.parse_args(["bench", option, "0"])
        assert "expected a positive integer, got '0'" in err.getvalue()
    args = parser.parse_args(["bench", "--sweep-bounds", "16, none"])
    assert args.sweep_bounds == (16, None)


def test_queue_rounds_help_gives_the_policy_the_bench_runs() -> None:
    from batchd.daemon.bench.queue import MAX_ROUNDS, MIN_ROUNDS, ROUNDS_BUDGET_S

    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    text = " ".join(out.getvalue().split())
    assert f"at least {MIN_ROUNDS}, more while the rounds have taken under " in text
    assert f"under {ROUNDS_BUDGET_S:.0f} s, at most {MAX_ROUNDS})" in text


@pytest.mark.slow
def test_quick_bench_on_bench_small(tmp_path: Path) -> None:
    """`batchd bench --quick` on the CPU benchmark model, every workload (a few minutes)."""
    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    model = make_model(tmp_path / "bench-small", FixtureSpec(preset="bench-small"))
    server = RedisServer(tmp_path / "redis").start()
    parser = argparse.ArgumentParser(prog="batchd")
    bench_cmd.register(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "--model", str(model), "--quick", "--out", str(tmp_path / "out")]
    )
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert args.func(args, load_settings(redis_url=server.url)) == 0
    finally:
        server.kill()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    for name in ("mixed", "shared-prefix"):
        assert set(report["workloads"][name]["systems"]) == OFFLINE_SYSTEMS[name]
    assert set(report["workloads"]["online"]["systems"]) == {"batchd", "batchgen"}
    assert report["workloads"]["queue"]["available"], report["workloads"]["queue"]
