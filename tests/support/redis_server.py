"""The tests' private redis-server per test: the product's own (batchd.daemon.redis_server)."""

from __future__ import annotations

from batchd.daemon.redis_server import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]
