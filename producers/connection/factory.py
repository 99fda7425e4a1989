"""The one way every batchd process opens Redis: a client (sync or asyncio) for a URL.

A plain URL goes to redis-py's ``from_url``. A ``redis+sentinel://`` URL (see
:mod:`batchd.config.sentinel`) gives a client on a Sentinel-managed pool:
each new connection asks the Sentinels for the master's address, and a connection
error or a demoted master's READONLY reply drops the connection, so the next attempt
(redis-py's retry, or batchd's own loops) reaches whichever server is master by then.
Callers pass the same keywords in both cases (socket timeouts, retry, health checks);
they apply to the master's connections. The Sentinels' connections get short timeouts
of their own, so one unreachable Sentinel delays a lookup by seconds at most.

The scheme picks the deployment; a Redis Cluster mode would be one more scheme here
(``redis+cluster://``, redis-py's ``RedisCluster``), with every caller unchanged.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.sentinel import Sentinel, SentinelConnectionPool

from batchd.config.sentinel import SentinelTarget, is_sentinel_url, parse_sentinel_url

# Longest wait on one Sentinel (connect or answer) while looking up the master.
SENTINEL_TIMEOUT_S = 2.0
# Keywords of a master connection that size the Sentinels' own.
_SOCKET_OPTIONS = ("socket_connect_timeout", "socket_keepalive", "socket_keepalive_options")


class _OwnedSentinelPool(SentinelConnectionPool):
    """A Sentinel-managed pool that owns its Sentinel clients: closing the client that
    holds it (a full disconnect) also closes the connections to the Sentinels."""

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        if inuse_connections:  # the client's close, not a master change
            for sentinel in self.sentinel_manager.sentinels:  # Sentinel.close: redis-py 8.1+
                sentinel.close()


class _AsyncOwnedSentinelPool(AsyncSentinelPool):
    """Asyncio twin of :class:`_OwnedSentinelPool`."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


class _AsyncOwnedSentinelBlockingPool(_AsyncOwnedSentinelPool, aioredis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits for a free connection (the gateway's)."""


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A client for the Redis ``url`` names: standalone, or a Sentinel deployment's
    master. ``options`` are redis-py connection keywords. ValueError on a bad URL."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    manager = Sentinel(target.sentinels, sentinel_kwargs=_sentinel_options(target, options))
    pool = _OwnedSentinelPool(target.service_name, manager, **{**target.master, **options})
    return redis.Redis.from_pool(pool)


def async_redis_client(url: str, **options: Any) -> aioredis.Redis:
    """Asyncio twin of :func:`redis_client`."""
    return aioredis.Redis.from_pool(async_redis_pool(url, **options))


def async_redis_pool(
    url: str, *, blocking: bool = False, **options: Any
) -> aioredis.ConnectionPool:
    """An asyncio pool for ``url``; ``blocking`` makes a caller wait for a free
    connection (``max_connections``, ``timeout``) instead of failing."""
    if not is_sentinel_url(url):
        plain = aioredis.BlockingConnectionPool if blocking else aioredis.ConnectionPool
        return plain.from_url(url, **options)
    target = parse_sentinel_url(url)
    manager = AsyncSentinel(target.sentinels, sentinel_kwargs=_sentinel_options(target, options))
    managed = _AsyncOwnedSentinelBlockingPool if blocking else _AsyncOwnedSentinelPool
    return managed(target.service_name, manager, **{**target.master, **options})


def _sentinel_options(target: SentinelTarget, options: dict[str, Any]) -> dict[str, Any]:
    """Keywords of the connections to the Sentinels: their credentials and TLS, short
    timeouts, the caller's keepalive."""
    timeout = min(options.get("socket_connect_timeout") or SENTINEL_TIMEOUT_S, SENTINEL_TIMEOUT_S)
    own = {k: v for k, v in options.items() if k in _SOCKET_OPTIONS}
    own.update(socket_connect_timeout=timeout, socket_timeout=timeout)
    own.update(target.sentinel)
    return own
