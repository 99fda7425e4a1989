"""The Batch API over HTTP: ``/v1/batches``, in OpenAI's format.

Creating a batch enqueues :func:`batchd.producers.gateway.batch_run.run_batch` on rq's
bulk queue (JSON serializer), naming the batch alone, with the batch id as the rq job
id; a ``batchd bulk-worker`` runs it. A batch's status is what its runner last
recorded, except that a runner that crashed for good (its rq job failed) makes it
``failed``. While a batch waits on something that is not there, its object says so in
``notice`` (``{"code", "message"}``, batchd's own field, absent otherwise): code
``no_bulk_worker`` when no bulk worker is alive on the rq queue (from their heartbeats,
so within seconds of the last one dying), ``no_daemon`` when it runs but no live daemon
consumes its queue. A batch is seen, listed and cancelled only with the key that made it: any
other id is a 404 that touches nothing. Its record expires 30 days after its window.
The gateway never generates anything itself.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from rq import Retry
from rq.exceptions import NoSuchJobError
from rq.job import JobStatus
from rq.serializers import JSONSerializer
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchd.producers.bulk import ABANDONED_RETRIES
from batchd.producers.bulk_worker import SafeJob, rq_queue
from batchd.producers.connection import is_cluster
from batchd.producers.gateway.batch_lines import ENDPOINTS
from batchd.producers.gateway.errors import APIError, invalid, not_found
from batchd.producers.gateway.files import Files, expiry_seconds, list_page, page_limit
from batchd.producers.gateway.fleet import BulkWorkers, Fleet
from batchd.producers.gateway.guard import Guard
from batchd.producers.gateway.online import read_json
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.params import check_metadata
from batchd.producers.gateway.store import (
    BATCH_RECORD_TTL_S,
    DEFAULT_EXPIRY_S,
    OUTPUT_LIFETIME,
    OWNER,
    SECRET,
    TERMINAL,
    batch_index,
    batch_key,
    encode,
    is_record_id,
    new_id,
    new_secret,
    owned,
    stop_key,
)
from batchd.producers.keys import Keys

COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600
CREATE_FIELDS = {
    "input_file_id",
    "endpoint",
    "completion_window",
    "metadata",
    "output_expires_after",
}
# The batch object's timestamps that are null until their status is reached.
STATUS_TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
# Statuses in which a batch still needs a bulk worker.
WAITING_ON_WORKER = {"validating", "in_progress", "finalizing", "cancelling"}


class Batches:
    """Batches of one gateway (see the module doc)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        sync: redis.Redis,
        keys: Keys,
        guard: Guard,
        files: Files,
        options: GatewayOptions,
        *,
        fleet: Fleet,
        workers: BulkWorkers,
    ) -> None:
        self.redis = redis
        self.sync = sync
        self.keys = keys
        self.guard = guard
        self.files = files
        self.options = options
        self.fleet = fleet
        self.workers = workers

    def routes(self) -> list[Route]:
        return [
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.listing, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    async def create(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        if is_cluster(self.sync):
            # rq's registries are keys of many slots: no worker could ever run the batch.
            raise APIError(
                503,
                "the Batch API runs on rq, which needs a Redis of its own beside a Redis "
                "Cluster: set bulk.rq_redis_url (BATCHD_BULK__RQ_REDIS_URL) for this "
                "gateway and its bulk workers",
                code="batch_api_unavailable",
            )
        body = await read_json(self.guard, request)
        unknown = sorted(set(body) - CREATE_FIELDS)
        if unknown:
            name = unknown[0]
            raise APIError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise invalid("endpoint", f"must be one of {', '.join(ENDPOINTS)}")
        if window != COMPLETION_WINDOW:
            raise invalid("completion_window", f"must be {COMPLETION_WINDOW!r}")
        metadata = body.get("metadata")
        check_metadata(metadata)
        lifetime = _output_lifetime(body.get("output_expires_after"))
        input_id = body.get("input_file_id")
        if not isinstance(input_id, str):
            raise invalid("input_file_id", "must be a file id")
        source = await self.files.record(input_id, owner, param="input_file_id")
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
            **dict.fromkeys(STATUS_TIMES),
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        private = {OWNER: owner, SECRET: new_secret(), OUTPUT_LIFETIME: lifetime}
        key = batch_key(self.keys, batch_id)
        await self.redis.hset(key, mapping=encode({**record, **private}))  # type: ignore[arg-type]
        await self.redis.expireat(key, created + WINDOW_S + BATCH_RECORD_TTL_S)
        await self.redis.zadd(batch_index(self.keys, owner), {batch_id: time.time()})
        await run_in_threadpool(self._enqueue, batch_id)
        notice = await self._notice(record)
        return JSONResponse({**record, **notice})

    def _enqueue(self, batch_id: str) -> None:
        limits = self.options.limits
        rq_queue(self.sync, self.options.rq_queue).enqueue_call(
            "batchd.producers.gateway.batch_run.run_batch",
            kwargs={
                "batch_id": batch_id,
                "queue": self.options.queue,
                "prefix": self.keys.prefix,
                "window": self.options.batch_window,
                "limits": None if limits is None else limits.model_dump(),
                "default_max_tokens": self.options.default_max_tokens,
            },
            timeout=-1,
            retry=Retry(max=ABANDONED_RETRIES),
            job_id=batch_id,
            description=f"OpenAI batch {batch_id}",
        )

    async def listing(self, request: Request) -> Response:
        """Newest first, ``limit`` (1-100, default 20) at a time after the id ``after``."""
        owner = self.guard.owner(request)
        limit = page_limit(request.query_params.get("limit"), default=20, most=100)

        async def fetch(ids: list[str]) -> list[dict[str, Any] | None]:
            found: list[dict[str, Any] | None] = []
            for batch_id in ids:
                try:
                    found.append(await self._batch(batch_id, owner))
                except APIError:  # its record has expired
                    found.append(None)
            return found

        page = await list_page(
            self.redis,
            batch_index(self.keys, owner),
            fetch,
            after=request.query_params.get("after"),
            limit=limit,
            desc=True,
            missing=lambda after: not_found("batch", after, param="after", code="batch_not_found"),
        )
        return JSONResponse(page)

    async def retrieve(self, request: Request) -> Response:
        owner = self.guard.owner(request)
        return JSONResponse(await self._batch(request.path_params["batch_id"], owner))

    async def _batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        """The batch as OpenAI shows it; 404 when it does not exist or is another key's."""
        batch = None
        if is_record_id(batch_id):
            batch = owned(await self.redis.hgetall(batch_key(self.keys, batch_id)), owner)
        if batch is None:
            raise not_found("batch", batch_id, param="batch_id", code="batch_not_found")
        batch = {**dict.fromkeys(STATUS_TIMES), **batch}  # a record an older gateway wrote
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
        batch.update(await self._notice(batch))
        return batch

    async def _notice(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``{"notice": ...}`` when the batch waits on a missing bulk worker or daemon."""
        status = batch["status"]
        if status in WAITING_ON_WORKER and not await self.workers.live():
            rq_name = self.options.rq_queue
            message = (
                f"no batchd bulk worker is alive on rq queue {rq_name!r}: the batch waits "
                "until one runs (`batchd bulk-worker`, seeing the gateway's files folder)"
            )
            return {"notice": {"code": "no_bulk_worker", "message": message}}
        if status == "in_progress" and not await self.fleet.serving():
            message = (
                f"no live daemon consumes queue {self.options.queue!r}: the batch waits "
                "until one does (`batchd serve`)"
            )
            return {"notice": {"code": "no_daemon", "message": message}}
        return {}

    def _runner(self, batch_id: str) -> tuple[JobStatus | None, dict[str, Any]]:
        try:
            job = SafeJob.fetch(batch_id, connection=self.sync, serializer=JSONSerializer)
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
        stop = stop_key(self.keys, batch_id)
        await self.redis.set(stop, b"1", exat=batch["created_at"] + WINDOW_S + BATCH_RECORD_TTL_S)
        update = {"status": "cancelling", "cancelling_at": batch.get("cancelling_at") or now}
        fields = [item for pair in encode(update).items() for item in pair]
        # Only while the run has not ended: a run that finished since the read above keeps
        # its end (the stop key set first makes a run still finishing end cancelled).
        ended: Any = await self.redis.eval(
            _CANCEL, 1, batch_key(self.keys, batch_id), *_TERMINAL_VALUES, *fields
        )
        if ended is not None:
            return JSONResponse({**batch, "status": orjson.loads(ended)})
        return JSONResponse({**batch, **update})


# Terminal statuses as the record stores them (JSON), then the update's field/value pairs.
_TERMINAL_VALUES = sorted(orjson.dumps(status) for status in TERMINAL)
# KEYS[1] the batch's record; ARGV: the len(TERMINAL) terminal statuses, then the
# cancelling update's field/value pairs. The record's status when it is terminal (nothing
# written), else nil after writing the update.
_CANCEL = f"""
local status = redis.call('HGET', KEYS[1], 'status')
for i = 1, {len(TERMINAL)} do
  if status == ARGV[i] then return status end
end
redis.call('HSET', KEYS[1], unpack(ARGV, {len(TERMINAL) + 1}))
return nil
"""


def _output_lifetime(value: Any) -> int:
    """Seconds the batch's output and error files live (``output_expires_after``)."""
    if value is None:
        return DEFAULT_EXPIRY_S
    if not isinstance(value, dict) or set(value) - {"anchor", "seconds"}:
        raise invalid("output_expires_after", "must be {anchor: 'created_at', seconds: N}")
    seconds = value.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise invalid("output_expires_after.seconds", "must be an integer")
    return expiry_seconds(value.get("anchor"), seconds, param="output_expires_after")
