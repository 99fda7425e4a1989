"""Partitioned deployments as the tests see them (one redis-server with 3 partitions,
and a real Redis Cluster): the deployment a fixture hands a test (``partitioned`` in
tests/producers/conftest.py makes one), daemon settings, raw submits to a job's
partition, and jobs spread over the partitions (the one-run checks take the keys:
faults.checks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from faults.checks import fake_jobs

from batchd.config.settings import Settings
from batchd.producers.keys import JOB_FIELD, Keys
from support.daemon_harness import (
    ENGINE_OPTS,
    fast_settings,
    write_config,
)

# The partitions of the partitioned deployments: more than one, so jobs spread.
PARTITIONS = 3


@dataclass
class Partitioned:
    """A deployment laid out in PARTITIONS partitions: its URL, a client of the same kind
    the producers open (``admin``: a RedisCluster on a cluster), and its key names."""

    kind: str
    url: str
    admin: Any
    keys: Keys

    @property
    def cluster(self) -> bool:
        return self.kind == "cluster"


def partitioned(url: str, **daemon: Any) -> Settings:
    """The tests' fast settings, with queues of :data:`PARTITIONS` partitions."""
    settings = fast_settings(url, **daemon)
    settings.queue.partitions = PARTITIONS
    return settings


def partitioned_config(tmp: Path, url: str, **daemon: Any) -> Path:
    """A ``batchd serve`` config file of :func:`partitioned` settings and the test engine."""
    settings = partitioned(url, **daemon)
    for key, value in ENGINE_OPTS.items():
        setattr(settings.engine, key, value)
    settings.log_level = "INFO"
    return write_config(tmp / "batchd.toml", settings)


def submit(client: Any, keys: Keys, job: dict[str, Any], *, queue: str = "default") -> str:
    """A raw producer's submit: XADD to the partition the job's id names."""
    stream = keys.queue_for(queue, job["id"])
    entry: bytes = client.xadd(stream, {JOB_FIELD: orjson.dumps(job)})
    return entry.decode()


def spread(n: int, prefix: str, keys: Keys, **options: Any) -> list[dict[str, Any]]:
    """``n`` fake jobs, the i-th with an id of partition i mod partitions."""
    jobs = fake_jobs(n, prefix=prefix)
    for i, job in enumerate(jobs):
        job["id"] = id_in(keys, i % keys.partitions, f"{prefix}{i}-")
        job.update(options)
    return jobs


def id_in(keys: Keys, partition: int, prefix: str) -> str:
    """The first id ``<prefix><j>`` of ``partition``."""
    return next(f"{prefix}{j}" for j in range(1000) if keys.partition(f"{prefix}{j}") == partition)
