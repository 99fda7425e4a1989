"""The rq worker of bulk runs, which runs batchd's bulk functions and nothing else.

rq imports and calls whatever dotted path a job on its queue names. With the
JSON serializer no pickle runs, but anyone who can write to the rq queue could
still name ``shutil.copyfile`` or ``os.system`` and have the worker call it as
its user. This worker checks the name against an allow-list before rq imports
anything, and fails a foreign job (status failed, reason logged) untouched.
Callbacks (``on_success``, ``on_failure``, ``on_stopped``) are dotted paths read
from the job's hash too, imported and called by rq: batchd sets none, so the
worker runs none (:class:`NoCallbackJob`).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from rq import Queue, SimpleWorker, Worker
from rq.job import Job
from rq.serializers import JSONSerializer

log = logging.getLogger(__name__)

RQ_QUEUE = "batchd-bulk"

# Every function batchd enqueues on its rq queue, by the dotted name rq stores.
ALLOWED_FUNCTIONS = frozenset(
    {
        "batchd.producers.bulk.run_bulk",
        "batchd.producers.gateway.batch_run.run_batch",
    }
)


class NoCallbackJob(Job):
    """An rq Job whose callbacks are never imported nor called (each one named is logged)."""

    @property
    def success_callback(self) -> None:
        _refuse_callback(self, "on_success", self._success_callback_name)

    @property
    def failure_callback(self) -> None:
        _refuse_callback(self, "on_failure", self._failure_callback_name)

    @property
    def stopped_callback(self) -> None:
        _refuse_callback(self, "on_stopped", self._stopped_callback_name)


def _refuse_callback(job: Job, kind: str, name: str | None) -> None:
    if name:
        log.error("rq job %s: %s callback %r refused: batchd runs no callback", job.id, kind, name)


class _AllowListed:
    """Mixin over rq's workers: refuse a job whose function is not batchd's, before import."""

    def perform_job(self, job: Job, queue: Queue, execution: Any) -> bool:
        name = job.func_name
        if name not in ALLOWED_FUNCTIONS:
            reason = (
                f"refused: {name!r} is not a batchd bulk function (allowed: "
                + ", ".join(sorted(ALLOWED_FUNCTIONS))
                + ")"
            )
            log.error("rq job %s: %s", job.id, reason)
            worker: Any = self
            worker.handle_job_failure(job, queue, exc_string=reason, execution=execution)
            return False
        result: bool = super().perform_job(job, queue, execution)  # type: ignore[misc]
        return result


class BulkWorker(_AllowListed, Worker):
    """rq's forking worker, allow-listed."""


class BulkSimpleWorker(_AllowListed, SimpleWorker):
    """rq's in-process worker, allow-listed."""


def rq_queue(connection: redis.Redis, name: str = RQ_QUEUE) -> Queue:
    """The bulk queue, with rq's JSON serializer (never pickle)."""
    return Queue(name, connection=connection, serializer=JSONSerializer)


def bulk_worker(
    connection: redis.Redis, *, rq_queue_name: str = RQ_QUEUE, burst: bool, fork: bool = True
) -> bool:
    """Run an allow-listed rq worker (JSON serializer) on the bulk queue; True if it ran a job.

    rq's default worker runs each job in a forked work horse in its own session:
    killing only the worker leaves the horse running (and holding OUT's lock).
    ``fork=False`` runs jobs in the worker process itself (rq's SimpleWorker).
    """
    kind = BulkWorker if fork else BulkSimpleWorker
    worker = kind(
        [rq_queue(connection, rq_queue_name)],
        connection=connection,
        serializer=JSONSerializer,
        job_class=NoCallbackJob,
    )
    return worker.work(burst=burst)
