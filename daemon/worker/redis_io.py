"""Redis connections of the daemon, and the backoff used while Redis is away."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from batchd.config.settings import Settings
from batchd.producers.connection import redis_client

log = logging.getLogger(__name__)

# Errors that mean "Redis is not reachable now": keep the work, retry later.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
# Errors that mean "Redis is up but takes no writes now" (memory full, a replica during a
# failover): a state of the deployment that passes, not a reason to exit.
REDIS_REFUSING = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)


class ClusterUnsupported(RuntimeError):
    """The server runs in cluster mode, which batchd does not support yet."""


def refuse_cluster(client: redis.Redis) -> None:
    """Raise ClusterUnsupported for a cluster-mode server: a job's keys and its queue
    hash to different slots, so the scripts would fail with CROSSSLOT mid-run."""
    info: Any = client.info("cluster")
    if info.get("cluster_enabled"):
        raise ClusterUnsupported(
            f"{client.get_connection_kwargs().get('host')}:"
            f"{client.get_connection_kwargs().get('port')} is a Redis Cluster node; batchd "
            "needs a standalone Redis (or a primary with replicas): its scripts touch a "
            "job's keys and the queue stream together, which Cluster refuses (CROSSSLOT)"
        )


def connect(settings: Settings) -> redis.Redis:
    """A client for the daemon's loop or heartbeat, on a standalone Redis or a Sentinel
    deployment's master (which it follows across a failover: see
    :mod:`batchd.producers.connection`).

    socket_timeout exceeds XREADGROUP's BLOCK (redis-py #2807, #3138), and one
    quick retry reconnects a connection that a Redis restart left stale; longer
    outages are the worker's backoff to handle, not redis-py's.
    """
    return redis_client(
        settings.connection_url(),
        socket_timeout=settings.daemon.block_ms / 1000 + 5.0,
        socket_connect_timeout=2.0,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


class Backoff:
    """Exponential backoff between attempts to reach Redis, capped at ``cap_s``.

    Logs once when Redis goes away and once when it is back, with the outage
    length. ``up_since`` is when Redis last became reachable (claiming jobs
    of others waits a heartbeat TTL after that, so live daemons can refresh
    their heartbeats first).
    """

    def __init__(
        self,
        *,
        cap_s: float,
        base_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap_s = cap_s
        self.base_s = base_s
        self.clock = clock
        self.failures = 0
        # Since start, for the metrics: failed attempts, and outages that ended.
        self.errors_total = 0
        self.reconnects_total = 0
        self.down_since: float | None = None
        self.next_try = 0.0
        self.up_since = clock()

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def ready(self) -> bool:
        """True when Redis is up or the next retry is due."""
        return self.clock() >= self.next_try

    def delay(self) -> float:
        """Seconds until the next retry (0 when Redis is up)."""
        return max(0.0, self.next_try - self.clock())

    def failed(self, exc: BaseException, *, doing: str) -> None:
        now = self.clock()
        wait = min(self.cap_s, self.base_s * 2**self.failures)
        self.failures += 1
        self.errors_total += 1
        self.next_try = now + wait
        if self.down_since is None:
            self.down_since = now
            log.warning(
                "redis unreachable or refusing while %s (%s); retrying with backoff",
                doing,
                exc,
                extra={"event": "redis_lost"},
            )
        else:
            log.debug(
                "redis still unreachable or refusing while %s (%s); next try in %.2fs",
                doing,
                exc,
                wait,
            )

    def succeeded(self) -> None:
        if self.down_since is not None:
            now = self.clock()
            log.warning(
                "redis is back after %.1fs; carrying on",
                now - self.down_since,
                extra={"event": "redis_back"},
            )
            self.up_since = now
            self.reconnects_total += 1
        self.down_since = None
        self.failures = 0
        self.next_try = 0.0
