"""What the gateway knows of the fleet: live daemons' models, and how deep the queue is.

Both come from Redis alone: a daemon is live while its heartbeat key exists
(``<prefix>:daemon:<consumer>``, JSON with ``model`` and ``queues``), and the
queue's depth is its consumer group's ``lag`` (entries no daemon has read
yet; XLEN minus pending before Redis 7). Heartbeats are read at most once per
``cache_s``, so a burst of requests costs one SCAN, not one per request.
"""

from __future__ import annotations

import time
from pathlib import PurePath
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError

from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import DaemonHeartbeat

SCAN_COUNT = 500


class Fleet:
    """Live daemons serving ``queue`` and the queue's backlog, read from Redis."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, queue: str, *, cache_s: float = 1.0
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.cache_s = cache_s
        self._daemons: list[DaemonHeartbeat] = []
        self._read_at = -float("inf")

    async def daemons(self) -> list[DaemonHeartbeat]:
        """Daemons with a live heartbeat that consume this gateway's queue."""
        if time.monotonic() - self._read_at < self.cache_s:
            return self._daemons
        names = [k async for k in self.redis.scan_iter(self.keys.daemon_pattern, count=SCAN_COUNT)]
        values = await self.redis.mget(names) if names else []
        found = []
        for value in values:
            if value is None:  # expired since the SCAN
                continue
            try:
                beat = DaemonHeartbeat.model_validate_json(value)
            except ValidationError:  # not a heartbeat: someone else's key under the prefix
                continue
            if self.queue in beat.queues:
                found.append(beat)
        self._daemons, self._read_at = found, time.monotonic()
        return found

    async def models(self) -> list[str]:
        return sorted({d.model for d in await self.daemons() if d.model is not None})

    async def resolve(self, requested: str) -> str | None:
        """The served model a request names: its full id, or the last part of a path or
        hub id (``tiny`` for ``/models/tiny``); None when no live daemon serves it."""
        models = await self.models()
        if requested in models:
            return requested
        matches = [m for m in models if PurePath(m).name == requested]
        return matches[0] if len(matches) == 1 else None

    async def backlog(self) -> int:
        """Jobs on the queue that no daemon has read yet."""
        stream = self.keys.queue(self.queue)
        try:
            groups: Any = await self.redis.xinfo_groups(stream)
        except aioredis.ResponseError:  # no such stream yet: nothing waits
            return 0
        for group in groups:
            name = group.get("name")
            if (name.decode() if isinstance(name, bytes) else name) != CONSUMER_GROUP:
                continue
            if group.get("lag") is not None:
                return int(group["lag"])
            return max(0, int(await self.redis.xlen(stream)) - int(group.get("pending", 0)))
        return int(await self.redis.xlen(stream))
