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
    LayoutClaim,
    LayoutError,
    LayoutMismatch,
    LayoutNotWritable,
    async_keys_for,
    async_read_layout,
    claim_layout,
    keys_for,
    read_layout,
)

__all__ = [
    "LayoutClaim",
    "LayoutError",
    "LayoutMismatch",
    "LayoutNotWritable",
    "async_keys_for",
    "async_read_layout",
    "async_redis_client",
    "async_redis_pool",
    "async_reread_cluster",
    "claim_layout",
    "is_cluster",
    "keys_for",
    "read_layout",
    "redis_client",
    "reread_cluster",
]
