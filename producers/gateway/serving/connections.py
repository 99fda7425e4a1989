"""The gateway's Redis connections: bounded, checked, and back by themselves after a restart.

- **Commands** (submit, cancel, status, records) share one *blocking* pool of
  ``redis_max_connections``: a burst of requests waits up to ``redis_pool_timeout_s`` for
  a free connection instead of failing with "too many connections".
- **Every command is retried** on a connection error or timeout, reconnecting, with a
  backoff of at most :data:`RETRY_CAP_S`, for about ``redis_retry_s``: a connection
  left stale by a Redis restart or a failover is replaced on first use, and an outage
  shorter than that fails no request. Idle connections are also checked (PING) before
  use every :data:`HEALTH_CHECK_S`. The retried writes are idempotent (submit attaches
  to its own job id, records are whole-field sets).
- **Events reads** (:class:`~batchd.producers.gateway.hub.Hub`) have their own
  connection, which blocks; the hub retries by itself.
- **rq** (the Batch API) gets a blocking client, used from worker threads only.

Each comes from :mod:`batchd.producers.connection`, so a ``redis+sentinel://`` URL gives
pools that follow the master across a failover: the retry above reconnects to it. A
``redis+cluster://`` URL gives redis-py's cluster clients instead of pools: they keep a
pool per node (``redis_max_connections`` each; a burst beyond it fails with
MaxConnectionsError, which :func:`outlast` retries, instead of waiting), and follow
MOVED/ASK and a promoted replica themselves.
A request's submit is also retried whole (:func:`outlast`): some failures of a failover
never reach the per-command retry (a socket error while the pool hands out a connection,
a demoted master's READONLY reply).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from batchd.config.cluster import is_cluster_url
from batchd.producers.connection import async_redis_client, async_redis_pool, redis_client
from batchd.producers.follow import RECONNECT_ERRORS
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.keys import MAX_PARTITIONS

RETRY_CAP_S = 0.25
RETRY_BASE_S = 0.01
HEALTH_CHECK_S = 5
CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 10.0
RETRIED = [redis.ConnectionError, redis.TimeoutError]
# What a whole submit is retried on: the deployment is changing hands, not refusing it.
OUTAGE = (*RECONNECT_ERRORS, redis.exceptions.ReadOnlyError, OSError)
OUTAGE_PAUSE_S = 0.2
# A Cluster reader's connections per node: a blocked read for each partition the node
# serves (at most all of them), and the status reads beside them.
READER_CONNECTIONS = MAX_PARTITIONS + 2

log = logging.getLogger(__name__)
T = TypeVar("T")


def retries(retry_s: float) -> int:
    """Attempts after the first that cover about ``retry_s`` seconds of backoff."""
    if retry_s <= 0:
        return 0
    ramp = math.ceil(math.log2(RETRY_CAP_S / RETRY_BASE_S))  # the attempts below the cap
    return ramp + math.ceil(retry_s / RETRY_CAP_S)


async def outlast(call: Callable[[], Awaitable[T]], retry_s: float, what: str) -> T:
    """``call()``, called again while it fails with an :data:`OUTAGE` error, for up to
    ``retry_s`` seconds; then the last error. Only for idempotent calls."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return await call()
        except OUTAGE as exc:
            if time.monotonic() + OUTAGE_PAUSE_S > deadline:
                raise
            log.warning("%s: %s: %s; retrying", what, type(exc).__name__, exc)
            await asyncio.sleep(OUTAGE_PAUSE_S)


def commands(redis_url: str, options: GatewayOptions) -> aioredis.Redis:
    """The pooled client for every short command."""
    retry = AsyncRetry(
        ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), retries(options.redis_retry_s)
    )
    common: dict[str, Any] = {
        "max_connections": options.redis_max_connections,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": COMMAND_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_S,
        "retry": retry,
    }
    if is_cluster_url(redis_url):
        return async_redis_client(redis_url, **common)
    pool = async_redis_pool(
        redis_url,
        blocking=True,
        timeout=options.redis_pool_timeout_s,
        retry_on_error=RETRIED,
        **common,
    )
    return aioredis.Redis.from_pool(pool)


def reader(redis_url: str, *, block_ms: int) -> aioredis.Redis:
    """The hub's connection: its reads block for up to ``block_ms``; no retry of its own.
    On a Cluster, a client whose per-node pools hold a blocked read per partition."""
    common: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": block_ms / 1000 + COMMAND_TIMEOUT_S,
        "retry": AsyncRetry(NoBackoff(), 0),
    }
    if is_cluster_url(redis_url):
        return async_redis_client(redis_url, max_connections=READER_CONNECTIONS, **common)
    pool = async_redis_pool(redis_url, max_connections=2, **common)
    return aioredis.Redis.from_pool(pool)


def blocking(redis_url: str, options: GatewayOptions) -> redis.Redis:
    """A blocking client (rq and the file sweeper run in threads), retried the same way."""
    return redis_client(
        redis_url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=COMMAND_TIMEOUT_S,
        health_check_interval=HEALTH_CHECK_S,
        retry=Retry(
            ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), retries(options.redis_retry_s)
        ),
        retry_on_error=RETRIED,
    )
