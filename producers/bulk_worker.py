"""The rq worker of bulk runs: batchd's bulk functions on batchd's files, and nothing else.

rq imports and calls whatever dotted path a job on its queue names, and a job's hash
names more that rq acts on by itself: callbacks (``on_success``, ``on_failure``,
``on_stopped``: imported and called, also by registry maintenance when it fails an
abandoned job), webhooks (an HTTP request to any URL with any headers), dependencies
(other jobs fetched and enqueued) and repeats. Anyone who can write to the rq queue
can write that hash. So:

- every job is loaded as :class:`SafeJob` (by the worker, by its queues and so by rq's
  registry maintenance and abandoned-job handling), which strips those features the
  moment it is read from Redis: nothing they name is imported, run or fetched;
- :class:`BulkQueue` refuses them at enqueue;
- the worker runs a job only if its function is allow-listed, it has no positional
  arguments, its keywords are that function's, and it named none of the features
  above; any other job fails untouched, before rq imports anything;
- the worker sets ``files_dir`` itself (its own folder; a job cannot name one), and the
  bulk functions open only plain names inside it (:mod:`batchd.producers.bulk_files`).

A worker, and the process running a job, keep heartbeats in rq's Redis, and every
worker requeues the runs of dead ones (:mod:`batchd.producers.bulk_liveness`). The
batchd jobs of a run go to the deployment's Redis, which on Redis Cluster is not rq's
(``bulk.rq_redis_url``): the worker names it to each run it performs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import redis
from rq import Queue, SimpleWorker, Worker
from rq.job import Job
from rq.serializers import JSONSerializer

from batchd.config.sections import RQ_QUEUE
from batchd.producers.bulk_liveness import Beat, Liveness, Reaper
from batchd.producers.bulk_run import deployment

log = logging.getLogger(__name__)
# How far past a runner's heartbeat TTL rq's record of its run is kept (rq's own margin).
RQ_MARGIN_S = 60

# Every function batchd enqueues on its rq queue, by the dotted name rq stores, with
# the keywords a job may give it (``files_dir`` is the worker's to give).
ALLOWED_FUNCTIONS: dict[str, frozenset[str]] = {
    "batchd.producers.bulk.run_bulk": frozenset({"run", "window", "queue", "prefix", "limits"}),
    "batchd.producers.gateway.batch_run.run_batch": frozenset(
        {"batch_id", "window", "queue", "prefix", "limits", "default_max_tokens"}
    ),
}


def named_features(job: Job) -> tuple[str, ...]:
    """The rq features ``job`` names that would make rq import, run or fetch something
    besides its function (as rq's enqueue options call them)."""
    named = {
        "on_success": job._success_callback_name,
        "on_failure": job._failure_callback_name,
        "on_stopped": job._stopped_callback_name,
        "webhooks": job.webhooks,
        "depends_on": job._dependency_ids,
        "repeat": job.repeats_left,
    }
    return tuple(name for name, value in named.items() if value)


class SafeJob(Job):
    """An rq Job that never imports, runs or fetches what its hash names besides its
    function: callbacks, webhooks, dependencies and repeats are dropped when it is read,
    and recorded in ``stripped`` (the worker then refuses to run it)."""

    stripped: tuple[str, ...] = ()

    def restore(self, raw_data: Any) -> Any:
        restored = super().restore(raw_data)
        self.stripped = named_features(self)
        if self.stripped:
            log.error("rq job %s: %s stripped: batchd runs none", self.id, ", ".join(self.stripped))
        self._success_callback_name = self._failure_callback_name = None
        self._stopped_callback_name = None
        self.webhooks = []
        self._dependency_ids = []
        self.repeats_left = None
        return restored

    # Belt and braces: a callback never resolves, whatever set its name.
    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None


class BulkQueue(Queue):
    """The bulk queue: jobs load as :class:`SafeJob`, and enqueueing one with a
    callback, webhook, dependency or repeat is refused (ValueError)."""

    job_class = SafeJob

    def create_job(self, *args: Any, **kwargs: Any) -> Job:
        job = super().create_job(*args, **kwargs)
        named = named_features(job)
        if named:
            raise ValueError(f"the bulk queue refuses {', '.join(named)}: batchd runs none")
        return job


def refusal(job: Job) -> str | None:
    """Why the worker must not run ``job`` (None: it may). Reads the job's data only."""
    name = job.func_name
    if name not in ALLOWED_FUNCTIONS:
        allowed = ", ".join(sorted(ALLOWED_FUNCTIONS))
        return f"refused: {name!r} is not a batchd bulk function (allowed: {allowed})"
    stripped = getattr(job, "stripped", ())
    if stripped:
        return f"refused: the job names {', '.join(stripped)}, which batchd never runs"
    if job.args or job.instance is not None or not isinstance(job.kwargs, dict):
        return "refused: batchd's bulk functions take keyword arguments only"
    # files_dir is always the worker's own (a retried job may carry the one it was given).
    unknown = sorted(set(job.kwargs) - ALLOWED_FUNCTIONS[name] - {"files_dir"})
    if unknown:
        return f"refused: {name} takes no {', '.join(map(repr, unknown))} from a job"
    return None


class _AllowListed:
    """Mixin over rq's workers: refuse a job (see :func:`refusal`) before rq imports its
    function; give an allowed one the worker's files folder and the deployment's Redis;
    beat for it while it runs."""

    files_dir: Path
    liveness: Liveness = Liveness()
    batchd: redis.Redis | None = None  # the deployment's Redis; None: rq's

    def perform_job(self, job: Job, queue: Queue, execution: Any) -> bool:
        worker: Any = self
        try:
            reason = refusal(job)
        except Exception as exc:  # data that does not even deserialize
            reason = f"refused: unreadable job data ({type(exc).__name__})"
        if reason is not None:
            log.error("rq job %s: %s", job.id, reason)
            worker.handle_job_failure(job, queue, exc_string=reason, execution=execution)
            return False
        job.kwargs = {**job.kwargs, "files_dir": str(self.files_dir)}
        # In rq's forked horse (or the worker itself without fork): the runner's beat, which
        # also keeps rq's own record of the run fresh, so that rq's registry maintenance
        # (which nothing refreshes while a --no-fork worker runs a job) never takes a
        # live run for an abandoned one.
        key = self.liveness.runner_key(job.id)
        fields = {"job": job.id, "worker": worker.name}
        member = getattr(execution, "composite_key", None)
        registry = queue.started_job_registry.key
        ahead_s = self.liveness.ttl_s + RQ_MARGIN_S

        def keep_started() -> None:
            if member is not None:
                job.connection.zadd(registry, {member: time.time() + ahead_s}, xx=True, gt=True)

        beat = Beat(job.connection, key, self.liveness, fields=fields, tick=keep_started)
        with beat, deployment(self.batchd):
            result: bool = super().perform_job(job, queue, execution)  # type: ignore[misc]
        return result


class BulkWorker(_AllowListed, Worker):
    """rq's forking worker, allow-listed."""


class BulkSimpleWorker(_AllowListed, SimpleWorker):
    """rq's in-process worker, allow-listed."""


def rq_queue(connection: redis.Redis, name: str = RQ_QUEUE) -> BulkQueue:
    """The bulk queue, with rq's JSON serializer (never pickle)."""
    return BulkQueue(name, connection=connection, serializer=JSONSerializer)


def bulk_worker(
    connection: redis.Redis,
    *,
    files_dir: str | Path,
    rq_queue_name: str = RQ_QUEUE,
    burst: bool,
    fork: bool = True,
    liveness: Liveness | None = None,
    batchd: redis.Redis | None = None,
) -> bool:
    """Run an allow-listed rq worker (JSON serializer) on the bulk queue; True if it ran a job.

    ``files_dir`` is the one folder its jobs read and write (``bulk.files_dir``: the
    gateway's and ``batchd bulk``'s too). rq's default worker runs each job in a forked
    work horse in its own session: killing only the worker leaves the horse running (and
    holding the output's lock). ``fork=False`` runs jobs in the worker process itself.
    While it works it keeps its heartbeat and requeues the runs of dead workers
    (``liveness``; default: prefix ``batchd``, the [bulk] section's defaults).
    ``connection`` is rq's Redis; ``batchd`` the deployment's, where the runs' batchd
    jobs go (None: the same Redis).
    """
    kind = BulkWorker if fork else BulkSimpleWorker
    worker = kind(
        [rq_queue(connection, rq_queue_name)],
        connection=connection,
        serializer=JSONSerializer,
        job_class=SafeJob,
        queue_class=BulkQueue,
    )
    worker.files_dir = Path(files_dir).resolve()
    worker.liveness = liveness = liveness or Liveness()
    worker.batchd = batchd
    reaper = Reaper(connection, rq_queue_name, liveness, SafeJob)
    fields = {"name": worker.name, "queues": [rq_queue_name]}
    key = liveness.worker_key(worker.name)
    with Beat(connection, key, liveness, fields=fields, tick=reaper.maybe):
        reaper.maybe()  # a restarted worker takes back its own run at once
        return worker.work(burst=burst)
