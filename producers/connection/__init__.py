"""Opening Redis, standalone or behind Sentinel: the one factory every batchd process uses
(:mod:`~batchd.producers.connection.factory`: sync and asyncio clients and pools for a
URL; the ``redis+sentinel://`` URL itself is :mod:`batchd.config.sentinel`'s)."""

from batchd.producers.connection.factory import async_redis_client, async_redis_pool, redis_client

__all__ = ["async_redis_client", "async_redis_pool", "redis_client"]
