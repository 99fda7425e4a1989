"""``batchd bulk`` and ``batchd bulk-worker``: bulk generation on rq (see batchd.producers.bulk)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchd.config.cluster import is_cluster_url
from batchd.config.settings import Settings
from batchd.producers.bulk import enqueue_bulk
from batchd.producers.bulk_liveness import Liveness
from batchd.producers.bulk_worker import SafeJob, bulk_worker
from batchd.producers.commands.redis_failure import REDIS_EXIT, REDIS_FAILURES, explain
from batchd.producers.commands.subcommand import add_command
from batchd.producers.connection import redis_client
from batchd.producers.errors import ValidationError

ENDED = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}
BAR_WIDTH = 30


def register(sub: Any) -> None:
    p = add_command(sub, "bulk", bulk)
    p.add_argument("input", metavar="IN.jsonl")
    p.add_argument("--out", required=True, metavar="OUT.jsonl")
    p.add_argument(
        "--window", type=int, default=None, help="most jobs in flight (default: bulk.window, 64)"
    )
    p.add_argument("--queue", default="default", help="batchd queue (default: default)")
    _rq_queue_option(p)
    p.add_argument("--follow", action="store_true", help="show progress until the run ends")
    _files_dir_option(p)

    p = add_command(sub, "bulk-worker", worker)
    _rq_queue_option(p)
    _files_dir_option(p)
    p.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    p.add_argument(
        "--no-fork",
        action="store_true",
        help="run jobs in this process (rq SimpleWorker; also bulk.fork = false)",
    )


def _rq_queue_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rq-queue", default=None, help="rq queue (default: bulk.rq_queue, batchd-bulk)"
    )


def _files_dir_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--files-dir",
        type=Path,
        default=None,
        help="the bulk files folder, which a worker never leaves (default: bulk.files_dir, "
        "else <state home>/gateway-files); the gateway, `batchd bulk` and the worker must "
        "share it",
    )


# Why the bulk commands refuse a Redis Cluster without a Redis of rq's own.
NO_CLUSTER = (
    "the bulk queue runs on rq, whose workers do not support Redis Cluster: give rq a "
    "standalone or Sentinel Redis of its own with bulk.rq_redis_url "
    "(BATCHD_BULK__RQ_REDIS_URL); the runs' batchd jobs still go to the cluster"
)


def rq_url(settings: Settings) -> str | None:
    """The URL of rq's Redis: ``bulk.rq_redis_url``, else the deployment's; None (said
    on stderr) for a Redis Cluster, on which rq's workers do not run."""
    url = settings.bulk.rq_redis_url or settings.connection_url()
    if is_cluster_url(url):
        print(f"batchd: {NO_CLUSTER}", file=sys.stderr)
        return None
    return url


def _connect(url: str) -> redis.Redis:
    return redis_client(url, socket_connect_timeout=5)


def bulk(args: argparse.Namespace, settings: Settings) -> int:
    """Run a JSONL file of jobs through batchd on rq, results to a JSONL file.

    Enqueue a bulk run on rq: IN is copied into the bulk files folder and OUT becomes a link to
    the run's output there; every line of IN (a job request, e.g. {"prompt": "..."}) goes to
    batchd with at most --window jobs in flight; one result line per input is appended to the
    output. Re-running with the same IN and OUT resumes. A `batchd bulk-worker` runs it.
    """
    url = rq_url(settings)
    if url is None:
        return 2
    connection = _connect(url)
    try:
        job = enqueue_bulk(
            connection,
            input_path=args.input,
            output_path=args.out,
            files_dir=args.files_dir or settings.bulk.folder(),
            window=settings.bulk.window if args.window is None else args.window,
            queue=args.queue,
            prefix=settings.key_prefix,
            limits=settings.limits,
            rq_queue_name=args.rq_queue or settings.bulk.rq_queue,
        )
    except ValidationError as exc:
        print(f"batchd: invalid bulk run: {exc}", file=sys.stderr)
        return 2
    except REDIS_FAILURES as exc:
        print(f"batchd: {explain(exc, url)}", file=sys.stderr)
        return REDIS_EXIT
    print(job.id)
    if not args.follow:
        return 0
    status = follow_progress(connection, job.id, stream=sys.stderr)
    if status is not JobStatus.FINISHED:
        print(f"batchd: bulk run {job.id} ended {status.value}: {_failure(job)}", file=sys.stderr)
        return 1
    return 0


def follow_progress(
    connection: redis.Redis, job_id: str, *, stream: TextIO, poll_s: float = 0.5
) -> JobStatus:
    """Draw the run's progress bar on ``stream`` until the rq job ends (each line padded
    over the longer one it replaces, so no tail of a message is left behind)."""
    width = 0
    while True:
        job = SafeJob.fetch(job_id, connection=connection, serializer=JSONSerializer)
        status = job.get_status()
        line = progress_bar(job.get_meta().get("progress") or {}, status)
        stream.write("\r" + line.ljust(width))
        width = max(width, len(line))
        stream.flush()
        if status in ENDED:
            stream.write("\n")
            return status
        time.sleep(poll_s)


def progress_bar(progress: dict[str, Any], status: JobStatus | None = None) -> str:
    """One line for the run: its bar once a worker counted its lines, before that what
    it waits for (a worker to take it, or the worker reading its input)."""
    total, done = progress.get("total"), progress.get("done", 0)
    if not total:
        if status is JobStatus.STARTED:
            return "a bulk worker took the run: reading its input..."
        return "queued: waiting for a bulk worker (batchd bulk-worker) to take it..."
    filled = int(BAR_WIDTH * done / total)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    failed = progress.get("failed", 0)
    rate = progress.get("tokens_per_s", 0.0)
    return f"[{bar}] {done}/{total} lines, {failed} failed, {rate:.1f} tokens/s"


def _failure(job: Job) -> str:
    result = job.latest_result()
    text = getattr(result, "exc_string", None) or ""
    return text.strip().splitlines()[-1] if text.strip() else "no details"


def worker(args: argparse.Namespace, settings: Settings) -> int:
    """Run the rq worker for bulk runs and Batch API batches.

    Take bulk runs and batches from --rq-queue and run them (one at a time per worker).
    The worker keeps a heartbeat in rq's Redis (bulk.rq_redis_url, else the
    deployment's; bulk.heartbeat_ttl_s), so the gateway can say when none is alive, and
    requeues the run of a worker that died (every bulk.reap_interval_s), which another
    worker, or this one restarted, resumes. The runs' batchd jobs go to the deployment.
    """
    url = rq_url(settings)
    if url is None:
        return 2
    deployment = settings.connection_url()
    connection = _connect(url)
    try:
        bulk_worker(
            connection,
            files_dir=args.files_dir or settings.bulk.folder(),
            rq_queue_name=args.rq_queue or settings.bulk.rq_queue,
            burst=args.burst,
            fork=settings.bulk.fork and not args.no_fork,
            liveness=Liveness.from_settings(settings.bulk, prefix=settings.key_prefix),
            batchd=None if deployment == url else _connect(deployment),
        )
    except REDIS_FAILURES as exc:
        print(f"batchd: {explain(exc, url)}", file=sys.stderr)
        return REDIS_EXIT
    return 0
