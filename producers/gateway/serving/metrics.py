"""The gateway's Prometheus metrics, served at ``/metrics`` on its own port.

Per route (its template, e.g. ``/v1/batches/{batch_id}``; ``other`` for a path no route
has): requests by method and status, requests in flight, the time to the whole answer
(to the end of a stream), and for generation routes the time to the first token as the
client sees it (from the request's arrival to the first token sent). Plus the jobs the
gateway follows and the connections its Redis pool holds (its nodes' pools, on a Redis
Cluster). Each app has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
OTHER = "other"


class Meter:
    """The gateway's metrics (one registry per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "batchd_gateway_requests",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "batchd_gateway_requests_in_flight",
            "Requests being answered (streams until they end), by route.",
            ["route"],
            registry=r,
        )
        self.duration = Histogram(
            "batchd_gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its answer (of its stream).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "batchd_gateway_time_to_first_token_seconds",
            "Time from a generation request's arrival to its first token sent to the client.",
            ["route"],
            buckets=FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.followed = Gauge(
            "batchd_gateway_jobs_followed", "Jobs whose events the gateway reads.", registry=r
        )
        self.redis_connections = Gauge(
            "batchd_gateway_redis_connections",
            "Connections of the gateway's Redis command pool, by state.",
            ["state"],
            registry=r,
        )

    def watch(self, followed: Callable[[], int], redis: Any) -> None:
        """Read the hub's and the Redis client's figures at each scrape."""
        self.followed.set_function(lambda: float(followed()))
        self.redis_connections.labels("in_use").set_function(lambda: connections(redis)[0])
        self.redis_connections.labels("open").set_function(lambda: connections(redis)[1])

    def token_sent(self, route: str, started: float) -> None:
        """A request's first token went to its client (``started``: time.monotonic() at
        its arrival)."""
        self.first_token.labels(route).observe(time.monotonic() - started)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def connections(redis: Any) -> tuple[float, float]:
    """Connections in use and open of a client: its pool's, or on a Redis Cluster summed
    over the pools of its nodes (redis-py keeps no public count of either)."""
    pool = getattr(redis, "connection_pool", None)
    if pool is not None:
        in_use = len(pool._in_use_connections)
        return in_use, in_use + len(pool._available_connections)
    nodes = redis.get_nodes()
    opened = sum(len(node._connections) for node in nodes)
    return opened - sum(len(node._free) for node in nodes), opened


class MetricsMiddleware:
    """Counts and times every request (pure ASGI: streams are timed to their end)."""

    def __init__(self, app: ASGIApp, *, meter: Meter, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.meter = meter
        self.routes = routes

    def route_of(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return str(getattr(route, "path", OTHER))
        return OTHER

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.route_of(scope)
        started = time.monotonic()
        scope.setdefault("state", {})["arrived"] = started
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        gauge = self.meter.in_flight.labels(route)
        gauge.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            gauge.dec()
            self.meter.requests.labels(route, scope["method"], str(status)).inc()
            self.meter.duration.labels(route).observe(time.monotonic() - started)


def arrived(request: Request) -> float:
    """When the request arrived (time.monotonic()), as the middleware noted it."""
    value = request.scope.get("state", {}).get("arrived")
    return float(value) if value is not None else time.monotonic()
