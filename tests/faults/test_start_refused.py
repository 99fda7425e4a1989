"""Scenarios 5 and 10: a daemon that must not start refuses with a clear error (the
``serve`` command exits 2): a consumer name a live daemon holds, a queue layout other
than the one the data is laid out in, a Cluster node reached by a plain redis:// URL.
The live daemon's heartbeat is untouched. (A daemon on a real Redis Cluster starts and
serves: tests/daemon/test_partitioned_cluster.py.)"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from batchd.daemon.fleet.heartbeat import ConsumerTaken
from batchd.daemon.worker.loop import Worker
from batchd.daemon.worker.redis_io import ClusterUrlNeeded
from faults.checks import KEYS, assert_all_done_once, fake_jobs
from support.daemon_harness import (
    DaemonProcess,
    FakeGenerator,
    daemon_config,
    enqueue,
    fast_settings,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer, free_port


def test_second_daemon_with_the_same_consumer_name_refuses(redis_server: RedisServer) -> None:
    client = redis_server.client()
    settings = fast_settings(redis_server.url)
    jobs = fake_jobs(2, prefix="twin")
    with worker_thread(settings, lambda: FakeGenerator(step_delay_s=0.01), consumer="same") as w:
        held = client.get(KEYS.daemon("same"))
        twin = Worker(settings, FakeGenerator(), consumer="same")
        with pytest.raises(ConsumerTaken) as refused:
            twin.run()
        assert "'same'" in str(refused.value) and f"pid {w.heartbeat.static['pid']}" in str(
            refused.value
        )
        assert socket.gethostname() in str(refused.value)
        twin.heartbeat.stop(remove=True)  # never removes the live daemon's key
        assert client.exists(KEYS.daemon("same"))
        assert client.get(KEYS.daemon("same")) is not None and held is not None
        for job in jobs:
            enqueue(client, KEYS, job)
        assert_all_done_once(client, jobs)


def test_serve_exits_2_naming_the_holder(
    redis_server: RedisServer, tmp_path: Path, tiny_model: Path
) -> None:
    config = daemon_config(tmp_path, redis_server.url)
    with worker_thread(fast_settings(redis_server.url), FakeGenerator, consumer="held") as w:
        twin = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d.log", consumer="held")
        assert twin.wait(60) == 2
        message = twin.log_tail()
        assert "consumer 'held' is already served by" in message
        assert f"pid {w.heartbeat.static['pid']}" in message


def test_serve_exits_2_when_the_stored_layout_differs(
    redis_server: RedisServer, tmp_path: Path, tiny_model: Path
) -> None:
    client = redis_server.client()
    client.set(KEYS.layout, '{"partitions": 4}')
    config = daemon_config(tmp_path, redis_server.url)
    daemon = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d.log")
    assert daemon.wait(60) == 2
    message = daemon.log_tail()
    assert "queue.partitions is 1 but the data under prefix 'batchd' is laid out in 4" in message
    assert "set queue.partitions = 4" in message
    assert client.get(KEYS.layout) == b'{"partitions": 4}'  # left as it was
    assert not client.keys("batchd:daemon:*") and not client.exists(KEYS.queue())


def test_a_cluster_node_behind_a_plain_url_is_refused_at_start(tmp_path: Path) -> None:
    binary = shutil.which("redis-server")
    assert binary is not None
    port = free_port()
    while port > 55000:  # the cluster bus listens on port + 10000
        port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    args += ["--cluster-enabled", "yes", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        wait_until(lambda: _pings(client), what="cluster node up")
        worker = Worker(fast_settings(f"redis://127.0.0.1:{port}/0"), FakeGenerator(), consumer="c")
        with pytest.raises(ClusterUrlNeeded, match="redis\\+cluster://"):
            worker.run()
    finally:
        proc.kill()
        proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
