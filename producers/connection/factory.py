"""The one way every batchd process opens Redis: a client (sync or asyncio) for a URL.

A plain URL goes to redis-py's ``from_url``. A ``redis+sentinel://`` URL (see
:mod:`batchd.config.sentinel`) gives a client on a Sentinel-managed pool:
a connection asks the Sentinels for the master's address each time it connects (the
reconnect of a command's retry too), and a connection error or a demoted master's
READONLY reply drops the connection, so the next attempt (redis-py's retry, or
batchd's own loops) reaches whichever server is master by then.
Callers pass the same keywords in both cases (socket timeouts, retry, health checks);
they apply to the master's connections. The Sentinels' connections get short timeouts
of their own, so one unreachable Sentinel delays a lookup by seconds at most.

A ``redis+cluster://`` URL (see :mod:`batchd.config.cluster`) gives redis-py's
cluster client, which follows ``MOVED``/``ASK`` redirections and retries
``TRYAGAIN``/``CLUSTERDOWN`` itself; batchd's keys keep every script's keys in one hash
slot (:mod:`batchd.producers.keys`). A cluster client is not a ``redis.Redis``: callers
that need one server's commands (a blocking read over several partitions, SCAN) ask
:func:`is_cluster`.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import redis
import redis.asyncio as aioredis
from redis._parsers.commands import AsyncCommandsParser, CommandsParser
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.asyncio.sentinel import SentinelManagedSSLConnection as AsyncSentinelSSLConnection
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.exceptions import RedisClusterException
from redis.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from batchd.config.cluster import is_cluster_url, parse_cluster_url
from batchd.config.sentinel import SentinelTarget, is_sentinel_url, parse_sentinel_url

# Longest wait on one Sentinel (connect or answer) while looking up the master.
SENTINEL_TIMEOUT_S = 2.0
# Keywords of a standalone pool that mean nothing to a cluster client (a blocking pool's
# wait; the asyncio cluster client takes only the keywords it names).
_NOT_FOR_CLUSTER = ("timeout", "single_connection_client")
_ASYNC_CLUSTER_KEYWORDS = frozenset(inspect.signature(AsyncRedisCluster.__init__).parameters)
# Keywords of a master connection that size the Sentinels' own.
_SOCKET_OPTIONS = ("socket_connect_timeout", "socket_keepalive", "socket_keepalive_options")


class _MasterConnection(SentinelManagedConnection):
    """A connection to the master that asks the Sentinels for the master's address at
    every connect. redis-py 8.1 asks only when its pool hands the connection out: the
    retry of a command whose connection dropped reconnects (``send_packed_command``) to
    the address the connection last had, a killed master's, for the whole retry budget
    (redis/redis-py#3874)."""

    def connect_to(self, address: tuple[str, int]) -> None:
        # The pool's connect, to the address it has just asked for.
        self.host, self.port = address
        check = self.connection_pool.check_connection
        super().connect_check_health(check_health=check, retry_socket_connect=False)

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if self._sock is None:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health, retry_socket_connect)


class _MasterSSLConnection(_MasterConnection, SentinelManagedSSLConnection):
    """:class:`_MasterConnection` over TLS."""


class _AsyncMasterConnection(AsyncSentinelConnection):
    """Asyncio twin of :class:`_MasterConnection`."""

    async def connect_to(self, address: tuple[str, int]) -> None:
        self.host, self.port = address
        check = self.connection_pool.check_connection
        await super().connect_check_health(check_health=check, retry_socket_connect=False)

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health, retry_socket_connect)


class _AsyncMasterSSLConnection(_AsyncMasterConnection, AsyncSentinelSSLConnection):
    """:class:`_AsyncMasterConnection` over TLS."""


class _OwnedSentinelPool(SentinelConnectionPool):
    """A Sentinel-managed pool (its connections: :class:`_MasterConnection`) that owns its
    Sentinel clients: closing the client that holds it (a full disconnect) also closes
    the connections to the Sentinels."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        tls = kwargs.get("ssl", False)  # redis-py's own pool takes it out of the keywords
        kwargs.setdefault("connection_class", _MasterSSLConnection if tls else _MasterConnection)
        super().__init__(service_name, sentinel_manager, **kwargs)

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        if inuse_connections:  # the client's close, not a master change
            for sentinel in self.sentinel_manager.sentinels:  # Sentinel.close: redis-py 8.1+
                sentinel.close()


class _AsyncOwnedSentinelPool(AsyncSentinelPool):
    """Asyncio twin of :class:`_OwnedSentinelPool`."""

    def __init__(self, service_name: str, sentinel_manager: AsyncSentinel, **kwargs: Any) -> None:
        tls = kwargs.get("ssl", False)
        master = _AsyncMasterSSLConnection if tls else _AsyncMasterConnection
        kwargs.setdefault("connection_class", master)
        super().__init__(service_name, sentinel_manager, **kwargs)

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


class _AsyncOwnedSentinelBlockingPool(_AsyncOwnedSentinelPool, aioredis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits for a free connection (the gateway's)."""


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a Redis Cluster client (sync or asyncio)."""
    return isinstance(client, RedisCluster | AsyncRedisCluster)


# What says a cluster node could not be reached (its slots may have a new primary).
_NODE_DOWN = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
)


def reread_cluster(client: object, exc: BaseException) -> None:
    """After ``exc`` from a Redis Cluster client, when it says a node could not be
    reached: read the cluster's slots and primaries again, from any node that answers
    (nothing when none does yet). redis-py 8.1's own refresh after a connection error
    can keep a killed primary's slots on it for good, so every later command fails."""
    if isinstance(client, RedisCluster) and isinstance(exc, _NODE_DOWN):
        with contextlib.suppress(redis.RedisError, RedisClusterException):
            client.nodes_manager.initialize()


async def async_reread_cluster(client: object, exc: BaseException) -> None:
    """Asyncio twin of :func:`reread_cluster`."""
    if isinstance(client, AsyncRedisCluster) and isinstance(exc, _NODE_DOWN):
        with contextlib.suppress(redis.RedisError, RedisClusterException):
            await client.nodes_manager.initialize()


def _node_down(replies: list[Any]) -> BaseException | None:
    """The first of a pipeline's replies (run with ``raise_on_error=False``: errors are
    replies) that says a node could not be reached; None when none does."""
    return next((reply for reply in replies if isinstance(reply, _NODE_DOWN)), None)


def known_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of a script call (EVAL, EVALSHA) or a stream read (XREAD, XREADGROUP:
    the first half of what follows STREAMS), or None for any other command. redis-py's
    cluster client asks a server (COMMAND GETKEYS, one round trip to one node) for the
    keys of every command whose keys move, and a cluster pipeline asks for every command
    it has no policy for, scripts included; those are most of batchd's commands."""
    name = _word(args[0]) if args else ""
    if name in ("EVAL", "EVALSHA") and len(args) > 2:
        return list(args[3 : 3 + int(args[2])])
    if name not in ("XREAD", "XREADGROUP"):
        return None
    i = 4 if name == "XREADGROUP" else 1  # past GROUP <group> <consumer>
    while i < len(args):
        word = _word(args[i])
        if word == "STREAMS":
            rest = args[i + 1 :]
            return list(rest[: len(rest) // 2]) if rest and len(rest) % 2 == 0 else None
        i += 1 if word == "NOACK" else 2  # COUNT n, BLOCK ms
    return None


def _word(arg: Any) -> str:
    return (arg.decode() if isinstance(arg, bytes) else str(arg)).upper()


class _StreamKeysParser(CommandsParser):
    """redis-py's parser of a command's keys, reading scripts' and stream reads' keys
    itself (:func:`known_keys`)."""

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        return known_keys(args) or super().get_keys(redis_conn, *args)


class _AsyncStreamKeysParser(AsyncCommandsParser):
    """Asyncio twin of :class:`_StreamKeysParser`."""

    async def get_keys(self, *args: Any) -> Any:
        return known_keys(args) or await super().get_keys(*args)


class _RereadingPipeline(ClusterPipeline):
    """redis-py's cluster pipeline, reading the slots again (:func:`reread_cluster`) after
    a node could not be reached, whether the error is raised or returned as a reply: it
    writes to the nodes' connections itself, past the client's ``execute_command``, and
    redis-py's own refresh misses a node it asks for a command's keys (COMMAND GETKEYS,
    its default node): killed, that node failed every later pipeline.
    :meth:`_RereadingCluster.pipeline` hands it out."""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            replies: list[Any] = super().execute(raise_on_error)
        except _NODE_DOWN as exc:
            reread_cluster(self, exc)
            raise
        if (down := _node_down(replies)) is not None:
            reread_cluster(self, down)
        return replies


class _AsyncRereadingPipeline(AsyncClusterPipeline):
    """Asyncio twin of :class:`_RereadingPipeline` (it reads through the client it was
    made from)."""

    __slots__ = ()

    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        try:
            replies: list[Any] = await super().execute(raise_on_error, allow_redirections)
        except _NODE_DOWN as exc:
            await async_reread_cluster(self.cluster_client, exc)
            raise
        if (down := _node_down(replies)) is not None:
            await async_reread_cluster(self.cluster_client, down)
        return replies


class _RereadingCluster(RedisCluster):
    """redis-py's cluster client, reading the slots again after a command or a pipeline
    found a node unreachable (:func:`reread_cluster`), so the next command reaches the
    replica promoted in a killed primary's place, and finding scripts' and stream reads'
    keys without asking a server (:func:`known_keys`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The parser redis-py built, its one method replaced: it holds no other state.
        self.commands_parser.__class__ = _StreamKeysParser

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except _NODE_DOWN as exc:
            reread_cluster(self, exc)
            raise

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        """redis-py's pipeline (it builds a ClusterPipeline by name), as a
        :class:`_RereadingPipeline`: the subclass adds a method, no state."""
        pipe = super().pipeline(transaction, shard_hint)
        pipe.__class__ = _RereadingPipeline
        return pipe


class _AsyncRereadingCluster(AsyncRedisCluster):
    """Asyncio twin of :class:`_RereadingCluster`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser.__class__ = _AsyncStreamKeysParser

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except _NODE_DOWN as exc:
            await async_reread_cluster(self, exc)
            raise

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> AsyncClusterPipeline:
        """See :meth:`_RereadingCluster.pipeline`."""
        pipe = super().pipeline(transaction, shard_hint)
        # redis-py's typing leaves its asyncio ClusterPipeline abstract (_event_dispatcher).
        pipe.__class__ = _AsyncRereadingPipeline  # type: ignore[type-abstract]
        return pipe


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A client for the Redis ``url`` names: standalone, a Sentinel deployment's
    master, or a Redis Cluster (a ``RedisCluster``, typed as the ``redis.Redis`` whose
    commands it shares). ``options`` are redis-py connection keywords. ValueError on a
    bad URL."""
    if is_cluster_url(url):
        return cluster_client(url, **options)  # type: ignore[return-value]
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    manager = Sentinel(target.sentinels, sentinel_kwargs=_sentinel_options(target, options))
    pool = _OwnedSentinelPool(target.service_name, manager, **{**target.master, **options})
    return redis.Redis.from_pool(pool)


def cluster_client(url: str, **options: Any) -> RedisCluster:
    """A cluster client for a ``redis+cluster://`` URL."""
    target = parse_cluster_url(url)
    nodes = [ClusterNode(host, port) for host, port in target.nodes]
    own = {k: v for k, v in options.items() if k not in _NOT_FOR_CLUSTER}
    return _RereadingCluster(startup_nodes=nodes, **{**target.options, **own})


def async_redis_client(url: str, **options: Any) -> aioredis.Redis:
    """Asyncio twin of :func:`redis_client`."""
    if is_cluster_url(url):
        return async_cluster_client(url, **options)  # type: ignore[return-value]
    return aioredis.Redis.from_pool(async_redis_pool(url, **options))


def async_cluster_client(url: str, **options: Any) -> AsyncRedisCluster:
    """Asyncio twin of :func:`cluster_client`; ``max_connections`` is per node."""
    target = parse_cluster_url(url)
    nodes = [AsyncClusterNode(host, port) for host, port in target.nodes]
    merged = {**target.options, **options}
    own = {k: v for k, v in merged.items() if k in _ASYNC_CLUSTER_KEYWORDS}
    return _AsyncRereadingCluster(startup_nodes=nodes, **own)


def async_redis_pool(
    url: str, *, blocking: bool = False, **options: Any
) -> aioredis.ConnectionPool:
    """An asyncio pool for ``url``; ``blocking`` makes a caller wait for a free
    connection (``max_connections``, ``timeout``) instead of failing. A Redis Cluster
    has no one pool: ValueError (use :func:`async_redis_client`)."""
    if is_cluster_url(url):
        raise ValueError("a Redis Cluster has a pool per node: open it with async_redis_client")
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
