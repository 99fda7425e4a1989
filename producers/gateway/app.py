"""The gateway's ASGI app: routes, error shapes, and what every handler shares.

Every error a client sees is OpenAI-shaped (:mod:`batchd.producers.gateway.errors`);
a Redis failure is a 503 with a fixed message (never the URL or password),
any other failure a 500 that says only "internal error" (details go to the log).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchd.producers.aio import AsyncClient
from batchd.producers.gateway.batches import Batches
from batchd.producers.gateway.errors import REDIS_DOWN, APIError
from batchd.producers.gateway.fleet import Fleet
from batchd.producers.gateway.guard import Guard
from batchd.producers.gateway.online import Online
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.keys import Keys

log = logging.getLogger(__name__)


def create_app(redis_url: str, options: GatewayOptions) -> Starlette:
    """The gateway app on one Redis; ``redis_url`` never appears in an answer."""
    client = AsyncClient(redis_url, prefix=options.prefix, queue=options.queue)
    keys = Keys(options.prefix)
    fleet = Fleet(client.redis, keys, options.queue)
    guard = Guard(
        options.api_keys,
        max_body_bytes=options.max_body_bytes,
        max_in_flight_per_key=options.max_in_flight_per_key,
    )
    online = Online(client, fleet, guard, options.queue, options.max_backlog, options.limits)
    batches = Batches(client.redis, redis_url, keys, guard, options)
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

    async def health(request: Request) -> Response:
        try:
            await client.redis.ping()
            daemons = len(await fleet.daemons())
            backlog = await fleet.backlog()
        except (redis.RedisError, OSError):
            return JSONResponse({"status": "unavailable", "redis": False, "daemons": 0}, 503)
        figures = {"redis": True, "daemons": daemons, "queue": options.queue, "backlog": backlog}
        return JSONResponse({"status": "ok", **figures})

    routes = [
        Route("/v1/chat/completions", online.chat, methods=["POST"]),
        Route("/v1/completions", online.completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        *batches.routes(),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()
        batches.close()

    return Starlette(
        routes=routes,
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
    log.warning("Redis error on %s: %s", request.url.path, type(exc).__name__)
    return _respond(REDIS_DOWN)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s", request.url.path)
    return _respond(APIError(500, "internal error", type="server_error", code="internal_error"))
