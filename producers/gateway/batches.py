"""The Batch API over HTTP: ``/v1/files`` and ``/v1/batches``, in OpenAI's format.

Creating a batch enqueues :func:`batchd.producers.gateway.batch_run.run_batch` on rq's
bulk queue (JSON serializer), with the batch id as the rq job id; a
``batchd bulk-worker`` runs it. A batch's status is what its runner last
recorded, except that a runner that crashed for good (its rq job failed)
makes it ``failed``. The gateway never generates anything itself.
"""

from __future__ import annotations

import time
from typing import Any

import redis
import redis.asyncio as aioredis
from rq import Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchd.producers.bulk import ABANDONED_RETRIES
from batchd.producers.bulk_worker import rq_queue
from batchd.producers.gateway.batch_lines import ENDPOINTS
from batchd.producers.gateway.errors import APIError, invalid, not_found
from batchd.producers.gateway.guard import Guard
from batchd.producers.gateway.online import parse_body
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.store import (
    OWNER,
    TERMINAL,
    batch_index,
    batch_key,
    encode,
    file_key,
    file_path,
    file_record,
    new_id,
    owned,
    stop_key,
)
from batchd.producers.keys import Keys

COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600


class Batches:
    """Files and batches of one gateway (see the module doc)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        redis_url: str,
        keys: Keys,
        guard: Guard,
        options: GatewayOptions,
    ) -> None:
        self.redis = redis
        self.sync = _sync_redis(redis_url)
        self.keys = keys
        self.guard = guard
        self.options = options
        self.files_dir = options.files_dir

    def close(self) -> None:
        self.sync.close()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files/{file_id}", self.file, methods=["GET"]),
            Route("/v1/files/{file_id}/content", self.content, methods=["GET"]),
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.listing, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    async def upload(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.options.max_file_bytes:
            raise APIError(413, f"file exceeds {self.options.max_file_bytes} bytes", param="file")
        async with request.form(max_part_size=self.options.max_file_bytes) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise invalid("purpose", "only 'batch' is supported")
            if upload is None or isinstance(upload, str):
                raise invalid("file", "a file part is required")
            data = await upload.read()
            filename = upload.filename or "upload.jsonl"
        file_id = new_id("file")
        self.files_dir.mkdir(parents=True, exist_ok=True)
        await run_in_threadpool(file_path(self.files_dir, file_id).write_bytes, data)
        record = file_record(
            file_id, filename=filename, size=len(data), purpose=purpose, created_at=int(time.time())
        )
        stored = encode({**record, OWNER: owner})
        await self.redis.hset(file_key(self.keys, file_id), mapping=stored)  # type: ignore[arg-type]
        return JSONResponse(record)

    async def _file(self, file_id: str, owner: str | None) -> dict[str, Any]:
        """The file record; 404 when it does not exist or is another key's."""
        record = owned(await self.redis.hgetall(file_key(self.keys, file_id)), owner)
        if record is None:
            raise not_found("file", file_id, param="file_id", code="file_not_found")
        return record

    async def file(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        return JSONResponse(await self._file(request.path_params["file_id"], owner))

    async def content(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        record = await self._file(request.path_params["file_id"], owner)
        data = await run_in_threadpool(file_path(self.files_dir, record["id"]).read_bytes)
        return Response(data, media_type="application/jsonl")

    async def create(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        body = parse_body(await self.guard.body(request))
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise invalid("endpoint", f"must be one of {', '.join(ENDPOINTS)}")
        if window != COMPLETION_WINDOW:
            raise invalid("completion_window", f"must be {COMPLETION_WINDOW!r}")
        source = await self._file(str(body.get("input_file_id")), owner)
        if source["purpose"] != "batch":
            raise invalid("input_file_id", "the file's purpose is not 'batch'")
        created = int(time.time())
        batch_id = new_id("batch")
        record = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": source["id"],
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "expires_at": created + WINDOW_S,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.get("metadata"),
        }
        stored = encode({**record, OWNER: owner})
        await self.redis.hset(batch_key(self.keys, batch_id), mapping=stored)  # type: ignore[arg-type]
        await self.redis.zadd(batch_index(self.keys, owner), {batch_id: time.time()})
        await run_in_threadpool(self._enqueue, batch_id)
        return JSONResponse(record)

    def _enqueue(self, batch_id: str) -> None:
        limits = self.options.limits
        rq_queue(self.sync).enqueue_call(
            "batchd.producers.gateway.batch_run.run_batch",
            kwargs={
                "batch_id": batch_id,
                "files_dir": str(self.files_dir.resolve()),
                "queue": self.options.queue,
                "prefix": self.keys.prefix,
                "window": self.options.batch_window,
                "limits": None if limits is None else limits.model_dump(),
            },
            timeout=-1,
            retry=Retry(max=ABANDONED_RETRIES),
            job_id=batch_id,
            description=f"OpenAI batch {batch_id}",
        )

    async def listing(self, request: Request) -> Response:
        """Newest first, ``limit`` (1-100, default 20) at a time after the id ``after``."""
        owner = self.guard.owner(request)
        limit_text = request.query_params.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise invalid("limit", "must be an integer from 1 to 100")
        limit, after = int(limit_text), request.query_params.get("after")
        index = batch_index(self.keys, owner)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(index, after)
            if not isinstance(rank, int):
                raise not_found("batch", after, param="after", code="batch_not_found")
            start = rank + 1
        ids = await self.redis.zrevrange(index, start, start + limit)
        names = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
        data = [await self._batch(name, owner) for name in names[:limit]]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(names) > limit,
            }
        )

    async def retrieve(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        return JSONResponse(await self._batch(request.path_params["batch_id"], owner))

    async def _batch(self, batch_id: str, owner: str | None) -> dict[str, Any]:
        """The batch as OpenAI shows it; 404 when it does not exist or is another key's."""
        batch = owned(await self.redis.hgetall(batch_key(self.keys, batch_id)), owner)
        if batch is None:
            raise not_found("batch", batch_id, param="batch_id", code="batch_not_found")
        if batch["status"] in TERMINAL:
            return batch
        status, progress = await run_in_threadpool(self._runner, batch_id)
        if status is JobStatus.FAILED:
            batch.update(status="failed", failed_at=batch.get("failed_at") or int(time.time()))
        if progress.get("total") is not None:
            done, failed = progress.get("done", 0), progress.get("failed", 0)
            batch["request_counts"] = {
                "total": progress["total"],
                "completed": done - failed,
                "failed": failed,
            }
        return batch

    def _runner(self, batch_id: str) -> tuple[JobStatus | None, dict[str, Any]]:
        try:
            job = Job.fetch(batch_id, connection=self.sync, serializer=JSONSerializer)
        except NoSuchJobError:
            return None, {}
        return job.get_status(), job.get_meta().get("progress") or {}

    async def cancel(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        batch_id = request.path_params["batch_id"]
        batch = await self._batch(batch_id, owner)
        if batch["status"] in TERMINAL:
            raise APIError(
                409, f"batch {batch_id} is already {batch['status']}", code="batch_not_cancellable"
            )
        now = int(time.time())
        await self.redis.set(stop_key(self.keys, batch_id), b"1")
        update = {"status": "cancelling", "cancelling_at": batch.get("cancelling_at") or now}
        await self.redis.hset(batch_key(self.keys, batch_id), mapping=encode(update))  # type: ignore[arg-type]
        return JSONResponse({**batch, **update})


def _sync_redis(redis_url: str) -> redis.Redis:
    """rq needs a blocking connection; used from a thread pool, never the event loop."""
    return redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
