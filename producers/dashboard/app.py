"""The dashboard's ASGI app: routes, security headers, and its background tasks.

Two tasks run beside the requests: the sampler (one fleet probe per refresh, for every
viewer) and the latency listener (final events, for TTFT and ITL). Every answer carries
a Content-Security-Policy that allows this site's own scripts, styles and connections
only (no inline script, no CDN, no framing), and pages are never cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchd.producers.aio import AsyncClient
from batchd.producers.connection import is_cluster, read_layout, redis_client
from batchd.producers.dashboard.actions import Actions, refused
from batchd.producers.dashboard.auth import OperatorAuth, Refused
from batchd.producers.dashboard.context import Dashboard
from batchd.producers.dashboard.fleet.latency import LatencyCollector
from batchd.producers.dashboard.fleet.probe import Prober
from batchd.producers.dashboard.fleet.sampler import Sampler
from batchd.producers.dashboard.live import job_stream, overview_stream, refreshing_stream
from batchd.producers.dashboard.options import DashboardOptions
from batchd.producers.dashboard.overview import OverviewSections
from batchd.producers.dashboard.pages import Pages
from batchd.producers.dashboard.records.audit import Audit
from batchd.producers.dashboard.render import HERE, environment

log = logging.getLogger(__name__)

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
]
# Pages that refresh in place (dead letters, batches): how often.
PAGE_REFRESH_S = 2.0
# How long shutdown waits for the background tasks, then for the Redis client to close.
SHUTDOWN_S = 5.0


def create_app(redis_url: str, options: DashboardOptions) -> Starlette:
    """The dashboard on one Redis (``redis_url`` never appears in a page)."""
    client = AsyncClient(
        redis_url, prefix=options.prefix, queue=options.queue, limits=options.limits
    )
    sync = redis_client(redis_url, socket_connect_timeout=5, socket_timeout=10)
    # Every page names jobs and queues: the deployment's layout, read now and, until a
    # daemon has stored it, again at each refresh (fleet.sampler).
    keys, stored = read_layout(sync, options.prefix)
    if not stored:
        log.warning(
            "no daemon has stored the key layout (%s) yet: the dashboard uses one partition's "
            "names until one does, and reads it again at each refresh",
            keys.layout,
        )
    audit = Audit(client.redis, keys)
    collector = LatencyCollector(keys)
    prober = Prober(
        client.redis, keys, discovery_s=options.discovery_s, band_sample=options.band_sample
    )
    sampler = Sampler(
        prober,
        collector,
        audit,
        sync,
        history_points=options.history_points,
        refresh_s=options.refresh_s,
        layout_stored=stored,
    )
    env = environment()
    dash = Dashboard(
        options=options,
        client=client,
        sync=sync,
        env=env,
        auth=OperatorAuth(options.operator_keys, session_ttl_s=options.session_ttl_s),
        audit=audit,
        sampler=sampler,
    )
    sections = OverviewSections(env, sampler.history, refresh_s=options.refresh_s)
    pages, actions = Pages(dash, sections), Actions(dash)
    page = pages.guarded
    routes = [
        Route("/", page(pages.overview), methods=["GET"]),
        Route("/jobs", page(pages.jobs), methods=["GET"]),
        Route("/jobs/{job_id}", page(pages.job), methods=["GET"]),
        Route("/dead", page(pages.dead), methods=["GET"]),
        Route("/batches", page(pages.batches), methods=["GET"]),
        Route("/live/overview", page(overview_stream(dash, sections)), methods=["GET"]),
        Route("/live/jobs/{job_id}", page(job_stream(dash)), methods=["GET"]),
        Route(
            "/live/dead",
            page(refreshing_stream(dash, pages.dead_sections, every_s=PAGE_REFRESH_S)),
            methods=["GET"],
        ),
        Route(
            "/live/batches",
            page(refreshing_stream(dash, pages.batches_sections, every_s=PAGE_REFRESH_S)),
            methods=["GET"],
        ),
        Route("/login", pages.login, methods=["GET"]),
        Route("/login", actions.login, methods=["POST"]),
        Route("/logout", actions.logout, methods=["POST"]),
        Route("/jobs/{job_id}/cancel", actions.cancel, methods=["POST"]),
        Route("/dead/redrive", actions.redrive, methods=["POST"]),
        Route("/daemons/{consumer:path}/control", actions.control, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await sampler.tick()  # the first page has figures
        except (redis.RedisError, OSError) as exc:
            log.warning("first overview probe failed: %s", type(exc).__name__)
        tasks = [asyncio.ensure_future(sampler.run())]
        if options.latency and is_cluster(client.redis):
            log.info(
                "latency charts off: Redis Cluster's sharded channels have no pattern "
                "subscription to hear every job's tokens"
            )
        elif options.latency:
            tasks.append(asyncio.ensure_future(collector.run(client.redis)))
        yield
        for task in tasks:
            task.cancel()
        # Bounded: a listener stuck closing its connection must not hold the shutdown.
        _, stuck = await asyncio.wait(tasks, timeout=SHUTDOWN_S)
        if stuck:
            log.warning("%d background task(s) did not stop in %.0f s", len(stuck), SHUTDOWN_S)
        with contextlib.suppress(asyncio.TimeoutError, redis.RedisError, OSError):
            await asyncio.wait_for(client.aclose(), SHUTDOWN_S)
        sync.close()

    async def on_refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        return refused(request, exc)

    async def on_redis_error(request: Request, exc: Exception) -> Response:
        log.warning("Redis error on %s: %s", request.url.path, type(exc).__name__)
        return _plain(503, "Redis is unreachable; the page will work again once it is back.")

    return Starlette(
        routes=routes,
        middleware=[Middleware(SecurityHeaders)],
        exception_handlers={Refused: on_refused, redis.RedisError: on_redis_error},
        lifespan=lifespan,
    )


def _plain(status: int, text: str) -> Response:
    return HTMLResponse(f"<!doctype html><title>{status}</title><p>{text}</p>", status_code=status)


class SecurityHeaders:
    """Adds :data:`HEADERS` to every answer, and ``no-store`` to all but static files."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = "/static/" in scope["path"]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"cache-control"]
                headers += HEADERS
                cache = b"public, max-age=300" if static else b"no-store"
                headers.append((b"cache-control", cache))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
