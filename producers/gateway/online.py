"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request, one job.

The order of checks is the order of cost: key, body size, parameters (400),
model (404), queue backlog (429), the caller's jobs in flight (429), then the
submit. The answer is read from the job's events stream (replay-safe), whole
or as SSE chunks. A client that goes away before the job ends gets its job
cancelled through batchd's cancellation path (status hash + cancel stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchd.config.limits import LimitSettings
from batchd.producers.aio import AsyncClient, AsyncJobHandle
from batchd.producers.errors import ValidationError
from batchd.producers.gateway.errors import APIError, invalid, too_busy
from batchd.producers.gateway.fleet import Fleet
from batchd.producers.gateway.guard import Guard
from batchd.producers.gateway.params import Mapped, chat_request, completion_request
from batchd.producers.gateway.shapes import CHAT, TEXT, Shaper
from batchd.producers.gateway.stream import DONE, EventStream, sse
from batchd.producers.result import FAILED_REASONS
from batchd.producers.schema import Event, JobRequest, new_job_id, validate_job

FAILED_STATUS = {"error": 500, "cancelled": 409, "expired": 504}


@dataclass
class Online:
    """The online endpoints of one gateway."""

    client: AsyncClient
    fleet: Fleet
    guard: Guard
    queue: str
    max_backlog: int
    limits: LimitSettings | None = None

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, CHAT, chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, TEXT, completion_request)

    async def _serve(
        self, request: Request, kind: str, mapper: Callable[[dict[str, object]], Mapped]
    ) -> Response:
        caller = self.guard.caller(request)
        body = parse_body(await self.guard.body(request))
        mapped = mapper(body)
        model = await self.fleet.resolve(mapped.model)
        if model is None:
            raise APIError(
                404,
                f"The model {mapped.model!r} does not exist or no live daemon serves it",
                param="model",
                code="model_not_found",
            )
        job = to_job(mapped, self.limits)
        backlog = await self.fleet.backlog()
        if backlog >= self.max_backlog:
            raise too_busy(
                f"the queue holds {backlog} waiting jobs (bound {self.max_backlog}); retry later",
                code="queue_full",
            )
        self.guard.acquire(caller)
        try:
            handle = await self.client.submit_request(job, queue=self.queue)
        except BaseException:
            self.guard.release(caller)
            raise
        shaper = Shaper(kind, handle.id, model, logprobs=mapped.logprobs)
        if mapped.stream:
            return self._stream(handle, shaper, mapped, caller)
        try:
            return await self._whole(request, handle, shaper)
        finally:
            self.guard.release(caller)

    async def _whole(self, request: Request, handle: AsyncJobHandle, shaper: Shaper) -> Response:
        collect = asyncio.ensure_future(_collect(handle))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                await asyncio.shield(handle.cancel())
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        tokens, final = collect.result()
        if final.finish_reason in FAILED_REASONS:
            raise failed(handle.id, final, kind=shaper.kind)
        return JSONResponse(shaper.whole(tokens, final))

    def _stream(
        self, handle: AsyncJobHandle, shaper: Shaper, mapped: Mapped, caller: str
    ) -> Response:
        ended = False

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal ended
            async for event in handle.stream():
                if not event.final:
                    yield sse(orjson.dumps(shaper.chunk(event)))
                    continue
                ended = True
                if event.finish_reason in FAILED_REASONS:
                    yield sse(orjson.dumps(failed(handle.id, event, kind=shaper.kind).body()))
                else:
                    yield sse(orjson.dumps(shaper.chunk(event)))
                    if mapped.include_usage:
                        yield sse(orjson.dumps(shaper.usage_chunk(event)))
                yield DONE

        async def cancel() -> None:
            await handle.cancel()

        return EventStream(
            chunks(),
            finished=lambda: ended,
            on_gone=cancel,
            on_close=lambda: self.guard.release(caller),
        )


def parse_body(raw: bytes) -> dict[str, object]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


def to_job(mapped: Mapped, limits: LimitSettings | None) -> JobRequest:
    """The JobRequest, validated as the daemon will (limits included); 400 names the field."""
    try:
        return validate_job({**mapped.job, "id": new_job_id()}, limits)
    except ValidationError as exc:
        field = exc.field.split(".", 1)[0]
        raise invalid(field, exc.message) from None


def failed(job_id: str, final: Event, *, kind: str) -> APIError:
    """The error of a job that ended without a completion. A daemon's refusal names the
    job field at fault first (``prompt: cannot tokenize: ...``, e.g. a chat request to a
    model without a chat template): that is the request's fault, a 400 naming it."""
    reason = final.finish_reason.value if final.finish_reason else "error"
    detail = f": {final.error}" if final.error else ""
    field = (final.error or "").split(":", 1)[0]
    if reason == "error" and field in JobRequest.model_fields:
        param = "messages" if kind == CHAT and field == "prompt" else field
        return invalid(param, f"refused by the daemon: {final.error}")
    return APIError(
        FAILED_STATUS.get(reason, 500),
        f"job {job_id} ended {reason}{detail}",
        type="server_error" if reason == "error" else "invalid_request_error",
        code=f"job_{reason}",
    )


async def _collect(handle: AsyncJobHandle) -> tuple[list[Event], Event]:
    tokens: list[Event] = []
    async for event in handle.stream():
        if event.final:
            return tokens, event
        tokens.append(event)
    raise AssertionError("a stream always ends with a final event")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
