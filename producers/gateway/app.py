"""The gateway's ASGI app: routes, error shapes, and what every handler shares.

Every error a client sees is OpenAI-shaped (:mod:`batchd.producers.gateway.errors`);
a Redis failure is a 503 with a fixed message (never the URL or password),
any other failure a 500 that says only "internal error" (details go to the log).
Redis is reached through :mod:`~batchd.producers.gateway.serving.connections` (a bounded pool,
retried commands) and the events of every job in flight through one
:class:`~batchd.producers.gateway.hub.Hub`; every request is counted and timed
(:mod:`~batchd.producers.gateway.serving.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchd.producers.aio import AsyncClient
from batchd.producers.bulk_files import FilesDir
from batchd.producers.gateway.batches import Batches
from batchd.producers.gateway.errors import APIError, redis_failure
from batchd.producers.gateway.expiry import Sweeper
from batchd.producers.gateway.files import Files
from batchd.producers.gateway.fleet import BulkWorkers, Fleet
from batchd.producers.gateway.guard import Guard
from batchd.producers.gateway.online import Online
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.responses.endpoint import Responses
from batchd.producers.gateway.serving import connections
from batchd.producers.gateway.serving.beat import gateway_beat
from batchd.producers.gateway.serving.health import Health
from batchd.producers.gateway.serving.hub import Hub, running
from batchd.producers.gateway.serving.metrics import Meter, MetricsMiddleware
from batchd.producers.keys import Keys

log = logging.getLogger(__name__)
# How long the hub's read blocks: it is woken at once for a new job, so this is only how
# often an idle gateway asks.
HUB_BLOCK_MS = 1000


def create_app(redis_url: str, options: GatewayOptions) -> Starlette:
    """The gateway app on one Redis; ``redis_url`` never appears in an answer.
    Raises ValueError for an empty API key (it would let a bare Bearer header in)."""
    guard = Guard(
        options.api_keys,
        max_body_bytes=options.max_body_bytes,
        max_in_flight_per_key=options.max_in_flight_per_key,
        body_timeout_s=options.body_timeout_s,
    )
    commands = connections.commands(redis_url, options)
    client = AsyncClient(commands, prefix=options.prefix, queue=options.queue)
    # The gateway's own records (files, batches, its heartbeat) carry the prefix alone;
    # job and queue names come from the deployment's layout, read on first use.
    keys = Keys(options.prefix)
    hub = Hub(connections.reader(redis_url, block_ms=HUB_BLOCK_MS), commands, client.layout)
    meter = Meter()
    meter.watch(lambda: hub.followed, commands)
    fleet = Fleet(commands, client.layout, options.queue)
    # rq's queue and its workers' heartbeats live on rq's Redis: on Redis Cluster one of
    # its own (bulk.rq_redis_url), since rq's workers do not run on a cluster.
    rq_url = options.rq_redis_url or redis_url
    own_rq = rq_url != redis_url
    rq_commands = connections.commands(rq_url, options) if own_rq else commands
    workers = BulkWorkers(rq_commands, options.prefix, options.rq_queue)
    online = Online(client, fleet, guard, hub, meter, options)
    responses = Responses(online)
    health = Health(commands, fleet, workers, queue=options.queue)
    folder = FilesDir.at(options.files_dir, create=False)  # made at the first upload
    # rq needs a blocking connection; used from a thread pool, never the event loop.
    sync = connections.blocking(redis_url, options)
    rq = connections.blocking(rq_url, options) if own_rq else sync
    files = Files(commands, keys, guard, folder, max_file_bytes=options.max_file_bytes)
    batches = Batches(commands, rq, keys, guard, files, options, fleet=fleet, workers=workers)
    sweeper = Sweeper(sync, keys, folder)
    beat = gateway_beat(sync, keys, queue=options.queue)  # the dashboard lists it
    started = time.time()

    async def models(request: Request) -> Response:
        guard.caller(request)
        return JSONResponse(
            {"object": "list", "data": [_model(m, started) for m in await fleet.models()]}
        )

    async def model(request: Request) -> Response:
        guard.caller(request)
        name = request.path_params["model"]
        resolved = await fleet.resolve(name)
        if resolved is None:
            raise APIError(
                404, f"The model {name!r} does not exist", param="model", code="model_not_found"
            )
        return JSONResponse(_model(resolved, started))

    routes = [
        Route("/v1/chat/completions", online.chat, methods=["POST"]),
        Route("/v1/completions", online.completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        *health.routes(),
        *files.routes(),
        *batches.routes(),
    ]
    if options.metrics:
        routes.append(Route("/metrics", meter.endpoint, methods=["GET"]))

    async def sweep_forever() -> None:
        while True:
            try:
                await run_in_threadpool(sweeper.sweep)
            except (redis.RedisError, OSError) as exc:
                log.warning("expired files not swept: %s", type(exc).__name__)
            await asyncio.sleep(sweeper.every_s)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sweeping = asyncio.ensure_future(sweep_forever())
        await run_in_threadpool(beat.__enter__)
        try:
            async with running(hub):
                yield
        finally:
            await run_in_threadpool(beat.stop)
        sweeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeping
        await client.aclose()
        await hub.conn.aclose()
        sync.close()
        if own_rq:
            await rq_commands.aclose()
            rq.close()

    return Starlette(
        routes=routes,
        middleware=[Middleware(MetricsMiddleware, meter=meter, routes=routes)],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            redis.RedisError: _redis_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )


def _respond(error: APIError) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _model(name: str, created: float) -> dict[str, object]:
    return {"id": name, "object": "model", "created": int(created), "owned_by": "batchd"}


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _respond(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "invalid_request"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _respond(APIError(exc.status_code, message, code=code))


async def _redis_error(request: Request, exc: Exception) -> Response:
    log.warning("Redis error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return _respond(redis_failure(exc))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s", request.url.path)
    return _respond(APIError(500, "internal error", type="server_error", code="internal_error"))
