"""Crash safety of ``batchd serve`` on the tiny model: SIGKILL at named moments, a second
daemon taking over, SIGTERM, and Redis restarting under a run.

Every run ends the same way: every job complete exactly once, its events
seq 0..n-1 (the stream ids make a duplicate impossible and the harness
refuses gaps), and its tokens equal to an uninterrupted in-process run, for
greedy and seeded sampling alike.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from test_serve import ChannelRecorder

from batchd.producers.client import Client
from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import JobState
from support.daemon_harness import (
    DaemonProcess,
    Reference,
    daemon_config,
    mixed_jobs,
    status_of,
    token_ids,
    wait_final,
    wait_until,
)
from support.redis_server import RedisServer

KEYS = Keys()


def _submit(url: str, jobs: list[dict[str, Any]]) -> None:
    with Client(url) as client:
        for job in jobs:
            client.submit_request(job)


def _check(
    redis_server: RedisServer, expected: dict[str, list[int]], *, timeout: float = 60
) -> None:
    client = redis_server.client()
    done = wait_final(client, KEYS, list(expected), timeout=timeout)
    for job_id, tokens in expected.items():
        assert token_ids(done[job_id]) == tokens, job_id
        assert status_of(client, KEYS, job_id).state is JobState.finished, job_id
    wait_until(
        lambda: client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0, what="all acked"
    )


CRASHES = [
    # (moment, consumer name of the daemon that crashes there: None = host:pid)
    ("prefill:3", "stable"),
    ("decode:20", "stable"),
    ("between_steps:40", None),
    ("after_final_event:1", "stable"),
    ("after_status:1", None),
]


def test_kill9_at_five_moments_loses_nothing(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, reference: Reference
) -> None:
    jobs = mixed_jobs(30, prefix="k", seed=2, max_tokens=(20, 120))
    expected = reference(jobs)
    recorder = ChannelRecorder(redis_server.url)
    config = daemon_config(tmp_path, redis_server.url, max_deliveries=20)
    _submit(redis_server.url, jobs)
    for n, (moment, consumer) in enumerate(CRASHES):
        daemon = DaemonProcess(
            config,
            model=tiny_model,
            log_path=tmp_path / f"d{n}.log",
            env={"BATCHD_TEST_CRASH_AT": moment},
            consumer=consumer,
        )
        rc = daemon.wait(60)
        assert rc == -signal.SIGKILL, f"{moment}: exit {rc}\n{daemon.log_tail()}"
    final = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "final.log")
    try:
        _check(redis_server, expected)
    finally:
        final.signal(signal.SIGTERM)
        assert final.wait(30) == 0, final.log_tail()
        recorder.close()
    for job_id in expected:
        seqs = recorder.seqs[job_id]
        assert seqs == sorted(set(seqs)), f"{job_id}: a subscriber saw a duplicate"
    logs = "".join((tmp_path / f"d{n}.log").read_text() for n in range(len(CRASHES)))
    assert "resumed at seq" in logs + (tmp_path / "final.log").read_text()


def test_second_daemon_takes_over_only_after_the_heartbeat_expires(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, reference: Reference
) -> None:
    client = redis_server.client()
    long_job = {"id": "long", "prompt_token_ids": [7, 8, 9], "max_tokens": 600, "ignore_eos": True}
    jobs = [long_job, *mixed_jobs(24, prefix="t", seed=3, max_tokens=(150, 300))]
    expected = reference(jobs)
    config = daemon_config(tmp_path, redis_server.url)
    daemons = {
        name: DaemonProcess(
            config, model=tiny_model, log_path=tmp_path / f"{name}.log", consumer=name
        )
        for name in ("a", "b")
    }
    for daemon in daemons.values():
        daemon.wait_serving()
    _submit(redis_server.url, jobs[:1])
    wait_until(lambda: client.hget(KEYS.job("long"), "daemon") is not None, what="long starts")
    owner = client.hget(KEYS.job("long"), "daemon").decode()  # type: ignore[union-attr]
    victim = "b" if owner == "a" else "a"
    _submit(redis_server.url, jobs[1:])
    wait_until(
        lambda: {client.hget(KEYS.job(j["id"]), "daemon") for j in jobs[1:]} >= {b"a", b"b"},
        what="both daemons running jobs",
    )
    time.sleep(0.6)  # over a heartbeat TTL with the long job pending and idle
    daemons[victim].kill()
    killed_at = time.monotonic()
    unfinished = [
        str(j["id"])
        for j in jobs
        if client.hmget(KEYS.job(j["id"]), ["state", "daemon"]) == [b"running", victim.encode()]
    ]
    assert unfinished, "the victim should die holding running jobs"
    try:
        _check(redis_server, expected, timeout=90)
        # Not before the victim's heartbeat (TTL 0.5 s, refreshed every 0.1 s) expired.
        assert time.monotonic() - killed_at > 0.4
    finally:
        daemons[owner].signal(signal.SIGTERM)
        assert daemons[owner].wait(30) == 0, daemons[owner].log_tail()
    assert status_of(client, KEYS, "long").daemon == owner
    # Every job the victim held unfinished was taken over.
    assert {status_of(client, KEYS, job_id).daemon for job_id in unfinished} == {owner}
    assert "claimed job entry" in (tmp_path / f"{owner}.log").read_text()
    assert "claimed job entry" not in (tmp_path / f"{victim}.log").read_text()


def test_sigterm_exits_within_grace_and_restart_completes(
    tmp_path: Path, redis_server: RedisServer, tiny_model: Path, reference: Reference
) -> None:
    client = redis_server.client()
    jobs = mixed_jobs(24, prefix="s", seed=4, max_tokens=(150, 250))
    expected = reference(jobs)
    config = daemon_config(tmp_path, redis_server.url, grace_period_s=0.2)
    daemon = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d1.log", consumer="w")
    daemon.wait_serving()
    _submit(redis_server.url, jobs)
    wait_until(lambda: client.xlen(KEYS.events("s0")) >= 5, what="tokens flowing")
    stopped = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(10) == 0, daemon.log_tail()
    assert time.monotonic() - stopped < 0.2 + 2.0
    pending: Any = client.xpending_range(KEYS.queue(), CONSUMER_GROUP, "-", "+", 100)
    assert pending, "SIGTERM with a short grace period should leave jobs pending"
    # Handed back: claimable at once, and a graceful stop does not count toward poison.
    assert all(p["times_delivered"] == 0 for p in pending), pending  # the next read makes it 1
    assert all(p["time_since_delivered"] >= 500 for p in pending)
    assert client.get(KEYS.daemon("w")) is None
    restarted = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d2.log", consumer="w")
    try:
        _check(redis_server, expected)
    finally:
        restarted.signal(signal.SIGTERM)
        assert restarted.wait(30) == 0, restarted.log_tail()


def test_redis_restart_mid_run(
    tmp_path: Path, redis_server_aof: RedisServer, tiny_model: Path, reference: Reference
) -> None:
    client = redis_server_aof.client()
    jobs = mixed_jobs(20, prefix="r", seed=5, max_tokens=(60, 160))
    expected = reference(jobs)
    config = daemon_config(tmp_path, redis_server_aof.url)
    daemon = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d.log").wait_serving()
    try:
        _submit(redis_server_aof.url, jobs)
        wait_until(lambda: client.xlen(KEYS.events("r0")) >= 5, what="tokens flowing")
        redis_server_aof.kill()
        time.sleep(0.5)
        redis_server_aof.start()
        _check(redis_server_aof, expected)
        assert daemon.proc.poll() is None
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.log_tail()
    log = daemon.log_path.read_text()
    assert "redis unreachable" in log and "redis is back" in log
