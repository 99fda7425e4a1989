"""Opening Redis, standalone, behind Sentinel or a Redis Cluster: the one factory every
batchd process uses (:mod:`~batchd.producers.connection.factory`: sync and asyncio
clients and pools for a URL; the URLs themselves are :mod:`batchd.config.sentinel`'s
and :mod:`batchd.config.cluster`'s), and the key layout the deployment stores
(:mod:`~batchd.producers.connection.layout`)."""

from batchd.producers.connection.factory import (
    async_redis_client,
    async_redis_pool,
    async_reread_cluster,
    is_cluster,
    redis_client,
    reread_cluster,
)
from batchd.producers.connection.layout import (
    LayoutMismatch,
    async_keys_for,
    claim_layout,
    keys_for,
)

__all__ = [
    "LayoutMismatch",
    "async_keys_for",
    "async_redis_client",
    "async_redis_pool",
    "async_reread_cluster",
    "claim_layout",
    "is_cluster",
    "keys_for",
    "redis_client",
    "reread_cluster",
]
