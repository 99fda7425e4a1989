"""Redis connections of the daemon, its checks at start, script calls that work in any
pipeline, and the backoff used while Redis is away."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from batchd.config.settings import Settings
from batchd.producers.connection import is_cluster, redis_client
from batchd.producers.connection.layout import LayoutClaim
from batchd.producers.keys import Keys

log = logging.getLogger(__name__)

# Errors that mean "Redis is not reachable now": keep the work, retry later. On a Redis
# Cluster also a slot with no live primary (between a primary's death and its replica's
# promotion), once redis-py's own retries are spent.
REDIS_DOWN = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
)
# Errors that mean "Redis is up but takes no writes now" (memory full, a replica during a
# failover, a slot mid-migration): a state of the deployment that passes, not a reason
# to exit.
REDIS_REFUSING = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
)


class ClusterUrlNeeded(RuntimeError):
    """A plain ``redis://`` URL names a Redis Cluster node."""


def claim_keys(layout: LayoutClaim, client: redis.Redis, queues: list[str]) -> Keys:
    """Check the deployment at start and claim ``layout`` (the daemon's queue.partitions,
    kept stored by its heartbeat: batchd.producers.connection.layout): its key names.
    ClusterUrlNeeded for a Cluster node reached by a plain URL (a client that follows no
    MOVED would write only the slots of that node); LayoutMismatch when the data is laid
    out in another partition count, LayoutNotWritable when this daemon's user may not
    read or store the layout key."""
    if not is_cluster(client):
        info: Any = client.info("cluster")
        if info.get("cluster_enabled"):
            kwargs = client.get_connection_kwargs()
            raise ClusterUrlNeeded(
                f"{kwargs.get('host')}:{kwargs.get('port')} is a Redis Cluster node: connect "
                "with redis+cluster://host:port[,host:port...] (every primary's slots)"
            )
    if layout.reassert(client) and layout.partitions > 1:
        _report_stranded(layout, client, queues)
    return layout.keys


def _report_stranded(layout: LayoutClaim, client: redis.Redis, queues: list[str]) -> None:
    """Log the jobs producers queued under the one-partition names while no layout was
    stored, now that this daemon stored one of more partitions: none of its daemons reads
    them (batchd.producers.connection.layout says why a producer may have)."""
    before = Keys(layout.prefix, tagged=is_cluster(client))
    for queue in queues:
        stream = before.queue(queue)
        entries: Any = client.xlen(stream)
        if entries and stream not in layout.keys.queue_partitions(queue):
            log.error(
                "%s holds %d job(s) queued under the one-partition names while no layout "
                "was stored (before the first daemon, or after %s was lost): no daemon of "
                "%d partitions reads that stream; submit them again",
                stream,
                entries,
                layout.key,
                layout.partitions,
                extra={"event": "jobs_stranded"},
            )


def pipeline_replies(pipe: Any) -> list[Any]:
    """Run ``pipe``: its replies, a command's error reply as its value; but an error that
    says Redis was not reached is raised, as a standalone Redis's pipeline raises it. A
    Redis Cluster's pipeline returns those per command too (a node gone mid-pipeline), and
    a reply that never came must not be read as an answer."""
    out: list[Any] = pipe.execute(raise_on_error=False)
    for reply in out:
        if isinstance(reply, REDIS_DOWN):
            raise reply
    return out


def queue_script(pipe: Any, script: Script, keys: list[str], args: list[Any]) -> None:
    """Queue a call of ``script`` into ``pipe``. redis-py's ClusterPipeline refuses
    ``evalsha`` by name, not the command: EVALSHA goes in by hand, and the caller loads
    the script first (:func:`load_scripts`), as a NOSCRIPT reply says nothing ran."""
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


def load_scripts(client: redis.Redis, *scripts: Script) -> None:
    """SCRIPT LOAD each script, in one round trip (on a Cluster, into every primary: each
    node has its own cache, and a promoted replica starts with none)."""
    if is_cluster(client):
        for script in scripts:
            client.script_load(script.script)
        return
    pipe = client.pipeline(transaction=False)
    for script in scripts:
        pipe.script_load(script.script)
    pipe.execute()


def connect(settings: Settings) -> redis.Redis:
    """A client for the daemon's loop or heartbeat, on a standalone Redis, a Sentinel
    deployment's master (which it follows across a failover) or a Redis Cluster (see
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
    their heartbeats first). A Redis Cluster's new slot map needs nothing of it: the
    client reads the slots again itself after a node is lost
    (:mod:`batchd.producers.connection.factory`).
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
