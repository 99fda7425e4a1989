"""A batch says when no bulk worker would run it, and a dead worker's batch goes on.

Bulk workers run as `batchd bulk-worker` processes with short heartbeats (2 s), as an
operator would shorten them with ``BATCHD_BULK__HEARTBEAT_TTL_S``; nothing here cleans
rq's registries by hand: the second worker finds the dead one's run by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
from test_gateway_batches import chat_line, start_batch

from batchd.producers.gateway.options import GatewayOptions
from support.daemon_harness import wait_until

API_KEY = "sk-test-gateway"
HEARTBEAT = {
    "BATCHD_BULK__HEARTBEAT_INTERVAL_S": "0.25",
    "BATCHD_BULK__HEARTBEAT_TTL_S": "2",
    "BATCHD_BULK__REAP_INTERVAL_S": "0.5",
}


@pytest.fixture
def batch_gateway(redis_url: str, daemon: Any, tmp_path: Path, start_gateway: Any) -> Iterator[Any]:
    options = GatewayOptions(api_keys=[API_KEY], files_dir=tmp_path / "files", batch_window=2)
    with start_gateway(redis_url, options) as gw:
        yield gw


@pytest.fixture
def workers(batch_gateway: Any, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "batchd.daemon.cli", "--redis-url"]
        command += [batch_gateway.redis_url, "bulk-worker", *flags, "--files-dir"]
        command.append(str(batch_gateway.options.files_dir))
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
        log = open(tmp_path / f"worker-{len(started)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            command, env={**env, **HEARTBEAT}, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_batch_says_when_no_worker_is_alive_and_resumes_after_a_kill(
    batch_gateway: Any, workers: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    oai = openai.OpenAI(base_url=batch_gateway.base_url, api_key=API_KEY, max_retries=0)
    lines = [
        chat_line(f"w-{i}", f"resume {i}", max_tokens=4 if i < 2 else 400, temperature=0)
        for i in range(10)
    ]
    conn = redis.Redis.from_url(batch_gateway.redis_url)
    added = int(conn.xinfo_stream("batchd:queue:default")["entries-added"])
    batch = start_batch(oai, tmp_path, lines)

    def notice() -> Any:
        return (oai.batches.retrieve(batch.id).model_extra or {}).get("notice")

    # Nobody would run it: the batch says so at once.
    assert batch.model_extra and batch.model_extra["notice"]["code"] == "no_bulk_worker"
    assert "batchd bulk-worker" in notice()["message"]

    first = workers("--no-fork")
    wait_until(lambda: notice() is None, timeout=20, what="the worker's heartbeat")

    def completed() -> int:
        counts = oai.batches.retrieve(batch.id).request_counts
        return counts.completed if counts is not None else 0

    wait_until(lambda: completed() >= 2, timeout=60, what="2 requests done")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    killed_at = time.monotonic()
    assert completed() < len(lines), "the batch ended before the kill: make it longer"
    wait_until(lambda: notice() is not None, timeout=10, what="no worker, said")
    assert notice()["code"] == "no_bulk_worker"
    wait_until(
        lambda: oai.batches.retrieve(batch.id).status == "in_progress", timeout=30, what="running"
    )

    workers("--no-fork")  # a restarted (or another) worker finds the dead one's run
    start = completed()
    wait_until(lambda: completed() > start, timeout=60, what="the batch resumed")
    resumed_s = time.monotonic() - killed_at
    wait_until(
        lambda: oai.batches.retrieve(batch.id).status == "completed", timeout=120, what="done"
    )
    assert resumed_s < 60, resumed_s
    done = oai.batches.retrieve(batch.id)
    assert done.request_counts is not None and done.request_counts.completed == len(lines)
    assert done.output_file_id is not None
    output = [orjson.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"w-{i}" for i in range(10))
    # Every request ran once: the resumed run reattached to the jobs in flight.
    assert int(conn.xinfo_stream("batchd:queue:default")["entries-added"]) - added == len(lines)
    conn.close()


def test_a_forked_work_horse_beats_for_its_run(
    batch_gateway: Any, workers: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """rq's default worker runs a batch in a forked horse: the horse keeps the run's
    heartbeat (so a worker killed alone leaves a live run alone) and rq's record of it
    fresh."""
    oai = openai.OpenAI(base_url=batch_gateway.base_url, api_key=API_KEY, max_retries=0)
    lines = [chat_line(f"f-{i}", f"fork {i}", max_tokens=1000, temperature=0) for i in range(6)]
    batch = start_batch(oai, tmp_path, lines)
    worker = workers()
    conn = redis.Redis.from_url(batch_gateway.redis_url)
    key = f"batchd:bulk:running:{batch.id}"
    wait_until(lambda: conn.exists(key), timeout=30, what="the horse's heartbeat")
    beat = orjson.loads(conn.get(key) or b"{}")
    assert beat["job"] == batch.id and beat["pid"] != worker.pid

    def kept_ahead() -> bool:
        scores = conn.zrange("rq:wip:batchd-bulk", 0, -1, withscores=True)
        return len(scores) == 1 and scores[0][1] > time.time() + 55

    # rq's record of the run, pushed past rq's own TTL by the horse's beat.
    try:
        wait_until(kept_ahead, timeout=10, what="rq's record of the run kept ahead")
    except AssertionError as exc:
        worker_log = (tmp_path / "worker-0.log").read_text(errors="replace")
        raise AssertionError(f"{exc}; the worker's log:\n{worker_log}") from None
    wait_until(
        lambda: oai.batches.retrieve(batch.id).status == "in_progress", timeout=30, what="running"
    )
    wait_until(
        lambda: oai.batches.retrieve(batch.id).status == "completed", timeout=120, what="done"
    )
    # The horse's beat ends with its run (after the run has written the batch's status).
    wait_until(lambda: not conn.exists(key), timeout=10, what="the horse's beat removed")
    conn.close()
