"""The metrics endpoint of a real daemon, scraped over HTTP while it runs real jobs."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from batchd.producers.keys import Keys
from support.daemon_harness import (
    ENGINE_OPTS,
    DaemonProcess,
    daemon_config,
    enqueue,
    mixed_jobs,
    token_ids,
    wait_final,
    wait_until,
)
from support.redis_server import RedisServer, free_port

KEYS = Keys()

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= set(lbl))


def test_metrics_move_with_the_jobs_run(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path
) -> None:
    client = redis_server.client()
    port = free_port()
    config = daemon_config(tmp_path, redis_server.url)
    daemon = DaemonProcess(
        config,
        model=tiny_model,
        log_path=tmp_path / "d.log",
        extra_args=["--metrics-port", str(port)],
    ).wait_serving()
    try:
        before = scrape(port)
        assert total(before, "batchd_output_tokens_total") == 0
        assert total(before, "batchd_info", model=str(tiny_model)) == 1
        # The forward backend chosen at start, with its sampler and the reason, once.
        assert total(before, "batchd_engine_backend_info") == 1

        jobs = mixed_jobs(12, prefix="p", seed=3, max_tokens=(20, 60))
        for job in jobs:
            enqueue(client, KEYS, {**job, "ignore_eos": True})
        wait_until(lambda: total(scrape(port), "batchd_output_tokens_total") > 0, what="tokens")
        during = scrape(port)
        done = wait_final(client, KEYS, [j["id"] for j in jobs], timeout=60)
        tokens = sum(len(token_ids(events)) for events in done.values())
        wait_until(
            lambda: total(scrape(port), "batchd_jobs_ended_total") == len(jobs), what="jobs ended"
        )
        # Gauges are set once per loop turn: the turn after the last publish empties them.
        wait_until(lambda: total(scrape(port), "batchd_jobs_held") == 0, what="jobs released")
        after = scrape(port)
    finally:
        daemon.signal(15)
        assert daemon.wait(30) == 0, daemon.log_tail()
        client.close()

    assert tokens == sum(j["max_tokens"] for j in jobs)
    for name in (
        "batchd_output_tokens_total",
        "batchd_step_duration_seconds_count",
        "batchd_publish_duration_seconds_count",
    ):
        assert before[(name, ())] <= during[(name, ())] <= after[(name, ())]
    assert total(after, "batchd_jobs_ended_total", state="finished", finish_reason="length") == 12
    assert total(after, "batchd_jobs_started_total") == 12
    assert total(after, "batchd_output_tokens_total") == tokens
    # One first token per job; a gap before every other token.
    assert total(after, "batchd_time_to_first_token_seconds_count") == 12
    assert total(after, "batchd_inter_token_latency_seconds_count") == tokens - 12
    steps = total(after, "batchd_step_duration_seconds_count")
    assert max(j["max_tokens"] for j in jobs) <= steps
    # Every step packs at least one sequence; every token came from a packed sequence.
    assert steps <= total(after, "batchd_step_batch_size_sum")
    assert tokens <= total(after, "batchd_step_batch_size_sum")
    prompt_tokens = sum(len(j["prompt_token_ids"]) for j in jobs)
    assert 0 < total(after, "batchd_prefill_tokens_total") <= prompt_tokens
    assert total(after, "batchd_step_duration_seconds_sum") > 0
    # Every token went out in a publish, each a round trip (in seconds: all under one).
    publishes = total(after, "batchd_publish_duration_seconds_count")
    assert publishes > total(before, "batchd_publish_duration_seconds_count")
    assert total(after, "batchd_publish_duration_seconds_bucket", le="1.0") == publishes
    assert total(after, "batchd_publish_duration_seconds_sum") > 0
    kv = total(after, "batchd_kv_blocks_used") + total(after, "batchd_kv_blocks_free")
    assert kv == ENGINE_OPTS["num_kv_blocks"]
    assert 0 <= total(after, "batchd_prefix_cache_hit_ratio") <= 1
    assert total(after, "batchd_redis_up") == 1
    assert total(after, "batchd_redis_errors_total") == 0
    assert total(after, "batchd_outbox_events") == 0
    assert total(after, "batchd_running_sequences") == 0
    assert total(after, "batchd_waiting_sequences") == 0
