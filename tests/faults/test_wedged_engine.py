"""Scenario 8: a wedged engine. Its heartbeat thread still beats, but the beat says
"work and no step for stall_timeout_s": other daemons count it as dead and take its
jobs, and it exits non-zero for its supervisor to restart it."""

from __future__ import annotations

import os
import subprocess
import sys

from batchd.daemon.fleet.heartbeat import EXIT_STALLED
from faults.checks import KEYS, assert_all_done_once, fake_jobs
from faults.wedged_daemon import STALL_TIMEOUT_S
from support.daemon_harness import (
    ROOT,
    FakeGenerator,
    enqueue,
    fast_settings,
    status_of,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer


def test_a_stalled_daemon_exits_and_its_jobs_are_taken_over(redis_server: RedisServer) -> None:
    client = redis_server.client()
    jobs = fake_jobs(3, prefix="wedge", max_tokens=40)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    wedged = subprocess.Popen(
        [sys.executable, "-m", "faults.wedged_daemon", redis_server.url, "wedged", "5"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: client.exists(KEYS.daemon("wedged")) == 1, timeout=30, what="start")
        for job in jobs:
            enqueue(client, KEYS, job)
        wait_until(
            lambda: client.xlen(KEYS.events("wedge0")) >= 3,
            timeout=30,
            what="tokens, then the stall",
        )
        settings = fast_settings(redis_server.url, stall_timeout_s=STALL_TIMEOUT_S)
        with worker_thread(settings, FakeGenerator, consumer="healthy"):
            assert wedged.wait(30) == EXIT_STALLED
            assert_all_done_once(client, jobs)
        assert {status_of(client, KEYS, job["id"]).daemon for job in jobs} == {"healthy"}
        assert b"engine stalled" in (wedged.stderr.read() if wedged.stderr else b"")
    finally:
        wedged.kill()
        wedged.wait(10)
