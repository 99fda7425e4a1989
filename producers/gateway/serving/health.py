"""``/health/live``, ``/health/ready`` and ``/health``: what a load balancer and a person ask.

- ``/health/live``: the process answers (200 always): restart it when this fails.
- ``/health/ready`` (and ``/health``, the same answer): 200 ``ok`` only when Redis
  answers and at least one live daemon (a heartbeat, a model loaded, not stopping)
  consumes the gateway's queue; otherwise 503 ``unavailable`` with ``missing`` naming
  what is not there (``redis``, ``daemon``) and a ``message`` saying what to do. Both
  carry the figures: daemons, models, backlog, live bulk workers (these do not gate
  readiness: online requests need none).

No key is needed, and nothing in an answer names the Redis URL.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchd.producers.gateway.fleet import BulkWorkers, Fleet, public_name

CHECK_ERRORS = (redis.RedisError, OSError)


class Health:
    """The health endpoints of one gateway."""

    def __init__(
        self, redis: aioredis.Redis, fleet: Fleet, workers: BulkWorkers, *, queue: str
    ) -> None:
        self.redis = redis
        self.fleet = fleet
        self.workers = workers
        self.queue = queue

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.ready, methods=["GET"]),
            Route("/health/ready", self.ready, methods=["GET"]),
            Route("/health/live", self.live, methods=["GET"]),
        ]

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        report = await self.report()
        return JSONResponse(report, 200 if report["status"] == "ok" else 503)

    async def report(self) -> dict[str, Any]:
        """The readiness answer (see the module doc)."""
        try:
            await self.redis.ping()
            serving = await self.fleet.serving()
            backlog = await self.fleet.backlog()
            workers = len(await self.workers.live())
        except CHECK_ERRORS:
            return {
                "status": "unavailable",
                "redis": False,
                "daemons": 0,
                "queue": self.queue,
                "missing": ["redis"],
                "message": "the job store (Redis) is unreachable",
            }
        models = sorted({public_name(b.model) for b in serving if b.model})
        report: dict[str, Any] = {
            "status": "ok" if serving else "unavailable",
            "redis": True,
            "daemons": len(serving),
            "models": models,
            "queue": self.queue,
            "backlog": backlog,
            "bulk_workers": workers,
        }
        if not serving:
            report["missing"] = ["daemon"]
            report["message"] = (
                f"no live daemon consumes queue {self.queue!r}: start `batchd serve` "
                "(requests would wait in the queue)"
            )
        return report
