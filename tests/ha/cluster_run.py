"""What the Redis Cluster acceptance tests share: a real ``batchd serve`` on the
cluster with a queue of 3 partitions, jobs submitted and followed throughout a fault
(a primary's kill, a slot's migration), and the checks the Sentinel twin makes
(tests/ha/test_sentinel_failover.py, whose producer this reuses; the checks are
tests/ha/ha_checks.py)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ha_checks import assert_each_job_once, mid_run, uninterrupted
from redis.crc import key_slot
from test_sentinel_failover import Producer, job_request

from batchd.daemon.cluster_server import ClusterDeployment
from batchd.producers.client import Client
from batchd.producers.keys import Keys
from support.daemon_harness import DaemonProcess, daemon_config, wait_until

PARTITIONS = 3
# The names every process uses on this cluster (tagged, as on any Redis Cluster).
KEYS = Keys(partitions=PARTITIONS, tagged=True)
FAULT_AFTER = 4  # jobs submitted before the fault


def partition_slot(partition: int) -> int:
    """The hash slot holding every key of queue partition ``partition``."""
    return key_slot(KEYS.queue("default", partition).encode())


def job_slot(job_id: str) -> int:
    return key_slot(KEYS.events(job_id).encode())


@contextmanager
def cluster_daemon(
    tmp_path: Path, cluster: ClusterDeployment, model: Path
) -> Iterator[DaemonProcess]:
    """``batchd serve`` on the cluster's URL with ``[queue] partitions = 3``, stopped by
    SIGTERM on exit (a non-zero exit fails the test, with its log)."""
    daemon = DaemonProcess(
        daemon_config(tmp_path, cluster.url),
        model=model,
        log_path=tmp_path / "daemon.log",
        env={"BATCHD_QUEUE__PARTITIONS": str(PARTITIONS)},
    )
    try:
        daemon.wait_serving(timeout=90)
        yield daemon
    finally:
        daemon.signal(signal.SIGTERM)
        code = daemon.wait(30)
    assert code == 0, daemon.log_tail()


def _followed(producer: Producer) -> bool:
    return not producer.is_alive() and not any(f.is_alive() for f in producer.followers)


def run_across(
    cluster: ClusterDeployment,
    daemon: DaemonProcess,
    jobs: int,
    fault: Callable[[list[str]], None],
) -> None:
    """Submit ``jobs`` jobs continuously and, once some run, call ``fault`` with the ids
    of the jobs running then; check every job once its producer has followed it to the end."""
    try:
        _run_across(cluster, daemon, jobs, fault)
    except AssertionError as exc:  # with what the processes said
        raise AssertionError(f"{exc}\n-- daemon:\n{daemon.log_tail()}") from exc


def _run_across(
    cluster: ClusterDeployment,
    daemon: DaemonProcess,
    jobs: int,
    fault: Callable[[list[str]], None],
) -> None:
    with Client(cluster.url, block_ms=200, reconnect_timeout_s=60) as client:
        producer = Producer(client, jobs)
        producer.start()
        wait_until(lambda: len(producer.submitted) >= FAULT_AFTER, timeout=30, what="first jobs")
        running: list[str] = []  # as last seen: a job may end between two looks

        with cluster.client() as watch:

            def some_running() -> bool:
                running[:] = mid_run(watch, KEYS, producer.submitted)
                return bool(running)

            wait_until(some_running, timeout=30, what="mid-run")
            fault(running)
        # Until every job is followed to its end; a daemon that died fails at once.
        wait_until(
            lambda: _followed(producer) or daemon.proc.poll() is not None,
            timeout=120,
            what="every job followed to its end",
        )
        assert daemon.proc.poll() is None, f"the daemon exited ({daemon.proc.returncode})"
        producer.join_all(timeout=5)
        assert not producer.errors, producer.errors
        job_ids = list(producer.submitted)
        assert len(job_ids) == jobs

        reference = uninterrupted(client, jobs, job_request)

    with cluster.client() as conn:
        delivered = {job_id: producer.delivered[job_id] for job_id in job_ids}
        assert_each_job_once(conn, KEYS, delivered, reference, queues=KEYS.queue_partitions())
