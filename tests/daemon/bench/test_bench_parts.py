"""The benchmark's pure parts: seeded workloads, arrival times, FLOP counting, stats."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
import threading
from pathlib import Path

import pytest
import redis

from batchd.config.settings import Settings
from batchd.daemon.bench.limit import ModelFlops
from batchd.daemon.bench.progress import Progress
from batchd.daemon.bench.queue import (
    MAX_ROUNDS,
    MIN_ROUNDS,
    ROUNDS_BUDGET_S,
    QueueUnavailable,
    _another_round,
    _compare,
    _daemon_env,
    _daemon_times,
    _delete_prefix,
    _failures_end_the_run,
    _redis_cpu_s,
    _spent,
    _times_between,
)
from batchd.daemon.bench.report import _queue_line
from batchd.daemon.bench.runner import BenchOptions, _queue_requests
from batchd.daemon.bench.stats import Recorder, step_profile
from batchd.daemon.bench.subscriber import SUBSCRIBER_NICE, run_as_subscriber
from batchd.daemon.bench.systems import SystemSettings
from batchd.daemon.bench.workloads import (
    SCALES,
    Request,
    Workload,
    mixed,
    poisson_arrivals,
    shared_prefix,
)
from batchd.engine.config import EngineConfig
from batchd.engine.models.model_fixture import PRESETS
from batchd.engine.outputs import StepStats
from support.redis_server import RedisServer, free_port

BENCH_SMALL = PRESETS["bench-small"]


def test_workloads_are_seeded_and_within_their_ranges() -> None:
    scale = SCALES["full"]
    first = mixed(scale=scale, vocab_size=32000, seed=0)
    assert first == mixed(scale=scale, vocab_size=32000, seed=0)
    assert first != mixed(scale=scale, vocab_size=32000, seed=1)
    assert len(first.requests) == 64
    for r in first.requests:
        assert 16 <= len(r.prompt_ids) <= 512 and 16 <= r.max_tokens <= 256
        assert all(16 <= t < 32000 for t in r.prompt_ids)


def test_shared_prefix_requests_share_exactly_the_prefix() -> None:
    w = shared_prefix(scale=SCALES["full"], vocab_size=32000)
    prefix = w.requests[0].prompt_ids[:512]
    assert w.shared_prefix_len == 512
    for r in w.requests:
        assert r.prompt_ids[:512] == prefix
        assert 16 <= len(r.prompt_ids) - 512 <= 64 and 64 <= r.max_tokens <= 128
    tails = {tuple(r.prompt_ids[512:]) for r in w.requests}
    assert len(tails) == len(w.requests)


def test_subset_spreads_over_the_list() -> None:
    w = mixed(scale=SCALES["full"], vocab_size=1000)
    part = w.subset(16)
    assert [r.request_id for r in part.requests] == [f"mixed-{i}" for i in range(0, 64, 4)]
    assert w.subset(100) is w


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = poisson_arrivals(n=4000, rate=2.0, seed=3)
    assert times == sorted(times) and times == poisson_arrivals(n=4000, rate=2.0, seed=3)
    assert len(times) / times[-1] == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(n=1, rate=0)


def test_bench_small_flops_match_two_times_params(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BENCH_SMALL))
    flops = ModelFlops.from_model_dir(tmp_path)
    # ~39M params: 8 layers x 2.82M + a 16.4M output head: ~78 MFLOP per token.
    assert flops.per_output_token / 1e6 == pytest.approx(77.9, abs=0.1)
    assert flops.attention_per_key == 4 * 8 * 8 * 64


def test_workload_flops_count_a_shared_prefix_once(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BENCH_SMALL))
    flops = ModelFlops.from_model_dir(tmp_path)
    one = Request("a", list(range(20, 52)), 4)
    alone = flops.workload_flops(Workload("w", [one]))
    # 32 prompt + 3 fed-back outputs; keys 1..35; 4 sampled tokens.
    expected = 35 * flops.linear_per_token + 630 * flops.attention_per_key
    assert alone == expected + 4 * flops.head_per_token
    twice = flops.workload_flops(Workload("w", [one, one], shared_prefix_len=16))
    second = 19 * flops.linear_per_token + (630 - 136) * flops.attention_per_key
    assert twice == alone + second + 4 * flops.head_per_token


def test_recorder_counts_tokens_ttft_and_gaps() -> None:
    done: list[tuple[int, int]] = []
    rec = Recorder(total=2, on_finish=lambda d, t: done.append((d, t)))
    rec.arrive("a", at=0.0)
    rec.arrive("b", at=0.0)
    rec.token("a")
    rec.token("a", finished=True)
    rec.token("b", count=3, finished=True)
    stats = rec.result()
    assert (stats.requests, stats.finished, stats.output_tokens) == (2, 2, 5)
    assert done == [(1, 2), (2, 2)]
    assert len(stats.ttft_s) == 2 and len(stats.itl_s) == 1 + 2
    assert stats.tok_s == pytest.approx(5 / stats.wall_s)
    assert set(stats.summary()) >= {"tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"}


def test_step_profile_weights_steps_by_the_decodes_they_hold_up() -> None:
    def step(seconds: float, decodes: int, prefill: int) -> StepStats:
        return StepStats(
            step=0, step_time_s=seconds, num_decode_tokens=decodes, num_prefill_tokens=prefill
        )

    steps = [step(0.010, 10, 0)] * 98 + [step(0.030, 1, 32), step(0.5, 0, 512)]
    profile = step_profile(steps)
    assert profile["steps"] == 100 and profile["steps_with_prefill"] == 1
    # 980 gaps at 10 ms, 1 at 30 ms; the prefill-only step holds up no decode.
    assert profile["gap_share_with_prefill"] == round(1 / 981, 4)
    assert profile["step_p50_s"] == profile["step_p99_s"] == 0.010
    assert profile["decode_only_p99_s"] == 0.010
    assert profile["with_prefill_p50_s"] == 0.030


def test_step_profile_times_the_commonest_decode_batch_alone() -> None:
    def step(seconds: float, decodes: int) -> StepStats:
        return StepStats(step=0, step_time_s=seconds, num_decode_tokens=decodes)

    # Three steps of 4 decodes, one of them slow; two larger, slower steps of 30 decodes
    # that outweigh them by gaps but not by count.
    steps = [step(0.010, 4), step(0.010, 4), step(0.020, 4), step(0.050, 30), step(0.050, 30)]
    profile = step_profile(steps)
    assert profile["decode_only_p50_s"] == 0.050
    assert (profile["same_batch_decodes"], profile["same_batch_steps"]) == (4, 3)
    assert profile["same_batch_p50_s"] == 0.010
    assert 0.010 < profile["same_batch_p99_s"] < 0.020
    assert step_profile([])["same_batch_steps"] == 0


# Three queue rounds between four in-process runs: 68.8 / 75.0, 80.0 / 74.75 and
# 73.0 / 73.75 tok/s, the third the median.
IN_PROCESS = [{"tok_s": tok_s, "ttft_p50_s": 1.0} for tok_s in (73.0, 77.0, 72.5, 75.0)]
QUEUED = [
    {"tok_s": tok_s, "ttft_p50_s": 1.0, "subscriber_cpu_s": 0.5, "redis_cpu_s": 0.4, "wall_s": 60.0}
    for tok_s in (68.8, 80.0, 73.0)
]


def test_queue_line_gives_the_median_and_the_shown_rounds_own_ratio() -> None:
    line = _queue_line(_compare(QUEUED, IN_PROCESS, requests=32))
    assert line.startswith("Queue: 0.99x in-process, the median of 3 rounds"), line
    assert ": 0.92x, 1.07x, 0.99x;" in line
    shown = "73.0 tok/s through Redis vs 73.8 in-process (mean of 72.5 before and 75.0 after)"
    assert f"{shown}, 0.99x." in line
    assert line.endswith("used 0.50 CPU-s of that 60.0 s run, Redis 0.40 CPU-s."), line


def test_queue_line_gives_the_daemons_publishing_against_its_steps() -> None:
    queued = [
        {**run, "daemon_publish_s": publish_s, "daemon_publishes": 90.0, "daemon_step_s": 6.0}
        for run, publish_s in zip(QUEUED, (0.12, 0.18, 0.15), strict=True)
    ]
    line = _queue_line(_compare(queued, IN_PROCESS, requests=32))
    assert "spent 2.0%-3.0% of its engine-step time publishing" in line, line
    assert line.endswith("In that run 0.150 s on 90 publishes against 6.00 s of engine steps.")


def test_queue_line_says_at_what_priority_the_client_ran() -> None:
    queued = [{**run, "subscriber_nice": 19} for run in QUEUED]
    line = _queue_line(_compare(queued, IN_PROCESS, requests=32))
    assert "The client (submit + follow, on a thread at nice 19, standing for clients" in line


def test_the_subscriber_runs_on_a_thread_of_its_own_at_the_lowest_priority() -> None:
    here = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, here)

    def work() -> tuple[int, int]:
        tid = threading.get_native_id()
        return tid, os.getpriority(os.PRIO_PROCESS, tid)

    (tid, nice_seen), nice = run_as_subscriber(work)
    assert tid != here
    if sys.platform.startswith("linux"):
        assert nice == nice_seen == SUBSCRIBER_NICE
    else:
        assert nice is None
    assert os.getpriority(os.PRIO_PROCESS, here) == before  # the caller's own is untouched


def test_the_subscribers_failure_is_raised_to_the_caller() -> None:
    def work() -> None:
        raise QueueUnavailable("not available: job j1 failed")

    with pytest.raises(QueueUnavailable, match="job j1 failed"):
        run_as_subscriber(work)


def test_the_daemons_times_are_left_out_where_its_metrics_cannot_be_read() -> None:
    assert _daemon_times(free_port()) is None  # nothing listens there
    before = {"daemon_publish_s": 0.5, "daemon_publishes": 10.0, "daemon_step_s": 2.0}
    after = {"daemon_publish_s": 0.75, "daemon_publishes": 30.0, "daemon_step_s": 5.5}
    assert _times_between(before, after) == {
        "daemon_publish_s": 0.25,
        "daemon_publishes": 20.0,
        "daemon_step_s": 3.5,
    }
    assert set(_times_between(None, after).values()) == {None}


def test_queue_rounds_run_to_the_time_budget_within_their_bounds() -> None:
    # Short runs: rounds go on while the budget lasts, never past MAX_ROUNDS.
    assert _another_round(MIN_ROUNDS, ROUNDS_BUDGET_S - 1, None)
    assert not _another_round(MAX_ROUNDS, 0.0, None)
    # Long runs: MIN_ROUNDS even past the budget, then no more.
    assert _another_round(MIN_ROUNDS - 1, ROUNDS_BUDGET_S * 3, None)
    assert not _another_round(MIN_ROUNDS, ROUNDS_BUDGET_S, None)
    # A count asked for is run exactly, whatever the time.
    assert _another_round(1, ROUNDS_BUDGET_S * 3, 2)
    assert not _another_round(2, 0.0, 2)


def test_redis_cpu_time_is_left_out_where_it_cannot_be_read(tmp_path: Path) -> None:
    """On a real redis-server: a user refused INFO (NOPERM) and a Redis that is gone give
    no figure instead of failing the queue run; a restart between readings gives none."""
    server = RedisServer(tmp_path).start()
    try:
        admin = server.client()
        assert (_redis_cpu_s(admin) or 0.0) > 0
        admin.acl_setuser(
            "noinfo", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-info"]
        )
        url = server.url.replace("redis://", "redis://noinfo:pw@")
        with redis.Redis.from_url(url) as refused:
            refused.ping()
            assert _redis_cpu_s(refused) is None
    finally:
        server.kill()
    assert _redis_cpu_s(admin) is None  # no server: connection refused
    assert _spent(1.0, 1.25) == 0.25
    assert _spent(5.0, 0.2) is None  # the counters started over
    assert _spent(None, 1.0) is None


def test_redis_failing_mid_run_ends_the_queue_run_alone(tmp_path: Path) -> None:
    """On a real redis-server: a refused command (NOPERM) and then a Redis that is gone,
    while the queue workload runs, make it "not available" (the full run still writes
    its report); cleaning the round's keys is best effort and says what it left."""
    server = RedisServer(tmp_path).start()
    said = io.StringIO()
    progress = Progress(stream=said)
    try:
        admin = server.client()
        admin.set("round-1:job:a", "x")
        admin.set("round-2:job:b", "x")
        _delete_prefix(admin, "round-1", progress)
        assert admin.keys("*") == [b"round-2:job:b"]
        admin.acl_setuser(
            "nodel", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-del"]
        )
        url = server.url.replace("redis://", "redis://nodel:pw@")
        with (
            redis.Redis.from_url(url) as refused,
            pytest.raises(QueueUnavailable, match="NoPermissionError"),
            _failures_end_the_run(),
        ):
            refused.delete("round-2:job:b")
    finally:
        server.kill()
    with pytest.raises(QueueUnavailable, match="ConnectionError"), _failures_end_the_run():
        admin.ping()
    _delete_prefix(admin, "round-2", progress)
    assert "could not delete the keys round-2:*" in said.getvalue()


def _every_option_changed() -> EngineConfig:
    """An engine config with every option away from its default (a valid whole)."""
    changed = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_prefill_tokens_with_decodes": 4,
        "prefill_fills_row_tile": False,
        "block_size": 32,
        "num_kv_blocks": 300,
        "kv_tokens_per_seq": 512,
        "kv_memory_fraction": 0.25,
        "enable_chunked_prefill": True,  # needed by the prefill bound; the default
        "enable_prefix_caching": False,
        "enable_preemption": False,
        "aging_rate": 0.5,
        "max_model_len": 2048,
        "dtype": "bfloat16",
        "speculative": "ngram",
        "speculative_draft_model": "/srv/models/draft",
        "num_speculative_tokens": 3,
        "speculative_ngram_min": 1,
        "speculative_ngram_max": 3,
        "speculative_max_decode_rows": 16,
        "kv_bits": 8,
        "kv_group_size": 32,
        "adapters": {"support": "/srv/adapters/support"},
        "max_resident_adapters": 2,
        "forward_backend": "mlx",
        "sampler": "host",
        "async_scheduling": True,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(EngineConfig)}, "a new option"
    return EngineConfig(**changed)


def test_every_engine_option_reaches_batchd_in_the_bench(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the settings (here BATCHD_ENGINE__* variables) through the command's options to
    the engine each run builds: nothing re-listed, nothing dropped."""
    from batchd.daemon.bench.engine_system import bench_engine_config
    from batchd.daemon.commands.bench import bench_engine

    wanted = _every_option_changed()
    for name, value in dataclasses.asdict(wanted).items():
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        monkeypatch.setenv(f"BATCHD_ENGINE__{name.upper()}", text)
    args = argparse.Namespace(max_num_seqs=None)
    engine = bench_engine(args, Settings())
    assert engine == wanted
    run = bench_engine_config(engine, longest_request=100, max_prefill_tokens_with_decodes=16)
    assert run == dataclasses.replace(wanted, max_prefill_tokens_with_decodes=16)
    # --max-num-seqs on top, with a step budget that lets them all decode.
    wider = bench_engine(argparse.Namespace(max_num_seqs=100), Settings())
    assert (wider.max_num_seqs, wider.max_num_batched_tokens, wider.block_size) == (100, 100, 32)
    # Unset, the pool holds every running sequence whole (no preemption in a run).
    sized = bench_engine_config(
        EngineConfig(max_num_seqs=4), longest_request=100, max_prefill_tokens_with_decodes=None
    )
    assert sized.num_kv_blocks == 4 * (7 + 1) + 64


def test_the_queue_daemon_gets_the_in_process_engine_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Field by field: both sides must run the same schedule on the same pool."""
    engine = _every_option_changed()
    settings = SystemSettings(
        model_path=Path("unused"), engine=engine, scale=SCALES["tiny"], vocab_size=1000
    )
    workload = mixed(scale=SCALES["tiny"], vocab_size=1000)
    systems = type("Systems", (), {"settings": settings, "warmup_for": lambda self, w: w})()
    env = _daemon_env(systems, workload, "redis://127.0.0.1:1/0", "prefix", 9123)  # type: ignore[arg-type]
    for name, value in env.items():
        if name.startswith(("BATCHD_ENGINE__", "BATCHD_DAEMON__")):
            monkeypatch.setenv(name, value)
    assert Settings().daemon.metrics_port == 9123  # where the bench reads its publish times
    assert Settings().engine == engine


def test_queue_requests_size_the_queue_workload_as_a_prefix_of_a_larger_one() -> None:
    from batchd.daemon.bench.workloads import SCALES
    from batchd.engine.config import EngineConfig

    def ids(count: int | None) -> list[str] | None:
        options = BenchOptions(
            model_path=Path("m"),
            model_label="m",
            workloads=("queue",),
            scale=SCALES["quick"],
            engine=EngineConfig(),
            redis_url="redis://unused",
            queue_requests=count,
        )
        work = _queue_requests(options, vocab_size=1000)
        return None if work is None else [r.request_id for r in work.requests]

    assert ids(None) is None  # the scale's own short_requests
    assert len(ids(300) or []) == 300
    assert (ids(300) or [])[:40] == ids(40)
