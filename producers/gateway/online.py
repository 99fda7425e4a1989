"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request, one job.

The order of checks is the order of cost: key, body size, parameters (400),
model (404), queue backlog (429), the caller's jobs in flight (429), then the
submit. The answer is read from the job's events stream through the gateway's
:class:`~batchd.producers.gateway.hub.Hub` (one Redis connection for every job in
flight), whole or as SSE chunks; a stream whose job is still queued gets a comment line
every ``sse_keepalive_s``. A client that goes away before the job ends gets its job
cancelled through batchd's cancellation path (status hash + cancel stream).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchd.producers.aio import AsyncClient, AsyncJobHandle
from batchd.producers.errors import JobNotFound, ProtocolError, ValidationError
from batchd.producers.gateway.errors import APIError, invalid, redis_failure, too_busy
from batchd.producers.gateway.fleet import Fleet
from batchd.producers.gateway.guard import Guard
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.params import (
    Mapped,
    chat_request,
    completion_request,
    fill_max_tokens,
)
from batchd.producers.gateway.refusals import context_exceeded, failed, param_of
from batchd.producers.gateway.serving.connections import outlast
from batchd.producers.gateway.serving.hub import Hub, Subscription
from batchd.producers.gateway.serving.metrics import Meter, arrived
from batchd.producers.gateway.shapes import CHAT, TEXT, Shaper
from batchd.producers.gateway.stream import DONE, KEEPALIVE, EventStream, sse
from batchd.producers.result import FAILED_REASONS
from batchd.producers.schema import Event, JobRequest, validate_job

REDIS_ERRORS = (redis.RedisError, OSError)
LOST = APIError(
    503,
    "the job's record was lost (did Redis restart without persistence?); retry",
    type="server_error",
    code="job_lost",
)


@dataclass
class Submitted:
    """A request turned into a running job: what answering it needs."""

    handle: AsyncJobHandle
    model: str
    mapped: Mapped
    caller: str
    started: float


@dataclass
class Online:
    """The online endpoints of one gateway."""

    client: AsyncClient
    fleet: Fleet
    guard: Guard
    hub: Hub
    meter: Meter
    options: GatewayOptions

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, CHAT, chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, TEXT, completion_request)

    async def submit(self, request: Request, mapped_of: Callable[[], Mapped]) -> Submitted:
        """Check, map and submit a request (``mapped_of`` reads its body); the caller's
        in-flight slot is taken: give it back with ``guard.release``."""
        caller = self.guard.caller(request)
        owner = self.guard.owner(request)
        mapped = mapped_of()
        # Every step reads or writes Redis; a retried submit attaches to its own job id.
        job_id = new_gateway_job_id()
        return await outlast(
            lambda: self._place(mapped, job_id, caller, owner, arrived(request)),
            self.options.redis_retry_s,
            "submit",
        )

    async def _place(
        self, mapped: Mapped, job_id: str, caller: str, owner: str, started: float
    ) -> Submitted:
        model = await self.fleet.resolve(mapped.model)
        if model is None:
            raise APIError(
                404,
                f"The model {mapped.model!r} does not exist or no live daemon serves it",
                param="model",
                code="model_not_found",
            )
        base, adapter = await self.fleet.split(model)
        if adapter is not None:
            mapped.job["adapter"] = adapter
        context = await self.fleet.context_of(base)
        fill_max_tokens(
            mapped.job,
            default=self.options.default_max_tokens,
            limits=self.options.limits,
            context=context,
        )
        job = to_job(mapped, job_id, self.options)
        refused = context_exceeded(mapped.job, context)
        if refused is not None:
            raise refused
        backlog = await self.fleet.backlog()
        if backlog >= self.options.max_backlog:
            raise too_busy(
                f"the queue holds {backlog} waiting jobs (bound {self.options.max_backlog}); "
                "retry later",
                code="queue_full",
            )
        self.guard.acquire(caller)
        try:
            # The job is the caller's key's: its status hash says so (key_id). Idempotent:
            # a submit retried after a lost reply attaches to its own (random) job id.
            handle = await self.client.submit_request(
                job, queue=self.options.queue, key_id=owner, idempotent=True
            )
        except BaseException:
            self.guard.release(caller)
            raise
        return Submitted(handle, model, mapped, caller, started)

    async def _serve(
        self, request: Request, kind: str, mapper: Callable[[dict[str, object]], Mapped]
    ) -> Response:
        self.guard.owner(request)  # 401 before a byte of the body is read
        body = await read_json(self.guard, request)
        job = await self.submit(request, lambda: mapper(body))
        mapped = job.mapped
        shaper = Shaper(
            kind,
            job.handle.id,
            job.model,
            logprobs=mapped.logprobs,
            tools=mapped.tools,
            top_logprobs=mapped.top_logprobs,
            echo=mapped.echo,
            include_usage=mapped.include_usage,
        )
        route = request.url.path
        if job.mapped.stream:
            return self._stream(job, shaper, route)
        try:
            tokens, final = await self.collect(request, job, route)
        finally:
            self.guard.release(job.caller)
        if final is None:
            return Response(status_code=499)  # nobody is listening any more
        if final.finish_reason in FAILED_REASONS:
            raise _failed(job.handle.id, final, shaper.kind, job.mapped)
        return JSONResponse(shaper.whole(tokens, final))

    async def collect(
        self, request: Request, job: Submitted, route: str
    ) -> tuple[list[Event], Event | None]:
        """The job's token events and final event; (.., None) when the client left first
        (the job is then cancelled)."""
        tokens: list[Event] = []

        async def read() -> Event:
            async with self.hub.subscribe(job.handle.id) as sub:
                async for event in sub.events():
                    if event.final:
                        return event
                    if not tokens:
                        self.meter.token_sent(route, job.started)
                    tokens.append(event)
            raise AssertionError("a stream always ends with a final event")

        collect = asyncio.ensure_future(read())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                await asyncio.shield(job.handle.cancel())
        if not collect.done() or collect.cancelled():
            return tokens, None
        try:
            return tokens, collect.result()
        except (JobNotFound, ProtocolError):
            raise LOST from None

    def _stream(self, job: Submitted, shaper: Shaper, route: str) -> Response:
        ended = False
        keepalive = self.options.sse_keepalive_s

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal ended
            try:
                async for chunk in self._chunks(job, shaper, route, keepalive):
                    yield chunk
            except (APIError, *REDIS_ERRORS) as exc:  # the job's record lost, Redis gone
                error = exc if isinstance(exc, APIError) else redis_failure(exc)
                yield sse(orjson.dumps(error.body()))
                yield DONE
            ended = True

        async def cancel() -> None:
            await job.handle.cancel()

        return EventStream(
            chunks(),
            finished=lambda: ended,
            on_gone=cancel,
            on_close=lambda: self.guard.release(job.caller),
        )

    async def _chunks(
        self, job: Submitted, shaper: Shaper, route: str, keepalive_s: float
    ) -> AsyncIterator[bytes]:
        """The SSE lines of a streamed job, to its final event and ``[DONE]``."""
        first = True
        async with self.hub.subscribe(job.handle.id) as sub:
            async for event in follow_events(sub, keepalive_s):
                if event is None:
                    yield KEEPALIVE
                    continue
                if event.final and event.finish_reason in FAILED_REASONS:
                    error = _failed(job.handle.id, event, shaper.kind, job.mapped)
                    yield sse(orjson.dumps(error.body()))
                    yield DONE
                    return
                for chunk in shaper.chunks(event):
                    if first and not event.final:
                        self.meter.token_sent(route, job.started)
                        first = False
                    yield sse(orjson.dumps(chunk))
                if event.final:
                    if job.mapped.include_usage:
                        yield sse(orjson.dumps(shaper.usage_chunk(event)))
                    yield DONE


async def follow_events(sub: Subscription, keepalive_s: float) -> AsyncIterator[Event | None]:
    """The job's events; None each time ``keepalive_s`` passes without one. A job whose
    record was lost ends the stream with an error event's worth: LOST."""
    while True:
        try:
            event = await sub.get(keepalive_s)
        except (JobNotFound, ProtocolError):
            raise LOST from None
        yield event
        if event is not None and event.final:
            return


async def read_json(guard: Guard, request: Request) -> dict[str, object]:
    """A JSON request's body as an object: refused (400, as OpenAI) when it is sent as
    another media type (``curl -d`` sends a form) or is no JSON object."""
    declared = request.headers.get("content-type")
    if declared is not None and not _is_json(declared):
        raise APIError(
            400,
            f"Unsupported content type: {declared!r}. This API method only accepts "
            "'application/json' requests.",
            code="unsupported_content_type",
        )
    return parse_body(await guard.body(request))


def _is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type, parameters (a charset) allowed."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def parse_body(raw: bytes) -> dict[str, object]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


def new_gateway_job_id() -> str:
    """A job id no other caller can guess (128 random bits from ``secrets``)."""
    return secrets.token_hex(16)


def to_job(mapped: Mapped, job_id: str, options: GatewayOptions) -> JobRequest:
    """The JobRequest, validated as the daemon will (limits included); 400 names the field."""
    try:
        return validate_job({**mapped.job, "id": job_id}, options.limits)
    except ValidationError as exc:
        raise invalid(param_of(exc.field), exc.message) from None


def _failed(job_id: str, final: Event, kind: str, mapped: Mapped) -> APIError:
    reason = final.finish_reason.value if final.finish_reason else "error"
    bias = mapped.job.get("logit_bias") or {}
    bias_ids = [int(t) for t in bias if str(t).isdigit()]
    return failed(job_id, reason, final.error, kind=kind, bias_ids=bias_ids)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
