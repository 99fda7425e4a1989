"""``batchd bulk`` and ``batchd bulk-worker``: bulk generation on rq (see batchd.producers.bulk)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchd.config.settings import Settings
from batchd.producers.bulk import enqueue_bulk
from batchd.producers.bulk_worker import RQ_QUEUE, bulk_worker
from batchd.producers.commands.subcommand import add_command
from batchd.producers.errors import ValidationError

ENDED = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}
BAR_WIDTH = 30


def register(sub: Any) -> None:
    p = add_command(sub, "bulk", bulk)
    p.add_argument("input", metavar="IN.jsonl")
    p.add_argument("--out", required=True, metavar="OUT.jsonl")
    p.add_argument("--window", type=int, default=64, help="most jobs in flight (default 64)")
    p.add_argument("--queue", default="default", help="batchd queue (default: default)")
    p.add_argument("--rq-queue", default=RQ_QUEUE, help=f"rq queue (default: {RQ_QUEUE})")
    p.add_argument("--follow", action="store_true", help="show progress until the run ends")

    p = add_command(sub, "bulk-worker", worker)
    p.add_argument("--rq-queue", default=RQ_QUEUE, help=f"rq queue (default: {RQ_QUEUE})")
    p.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    p.add_argument(
        "--no-fork", action="store_true", help="run jobs in this process (rq SimpleWorker)"
    )


def _connection(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)


def bulk(args: argparse.Namespace, settings: Settings) -> int:
    """Run a JSONL file of jobs through batchd on rq, results to a JSONL file.

    Enqueue a bulk run on rq: every line of IN (a job request, e.g. {"prompt": "..."}) goes to
    batchd with at most --window jobs in flight; one result line per input is appended to OUT.
    Re-running skips lines already in OUT. A `batchd bulk-worker` runs it.
    """
    connection = _connection(settings)
    try:
        job = enqueue_bulk(
            connection,
            input_path=args.input,
            output_path=args.out,
            window=args.window,
            queue=args.queue,
            prefix=settings.key_prefix,
            limits=settings.limits,
            rq_queue_name=args.rq_queue,
        )
    except ValidationError as exc:
        print(f"batchd: invalid bulk run: {exc}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"batchd: cannot reach Redis: {exc}", file=sys.stderr)
        return 3
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
    """Draw the run's progress bar on ``stream`` until the rq job ends."""
    while True:
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        status = job.get_status()
        stream.write("\r" + progress_bar(job.get_meta().get("progress") or {}))
        stream.flush()
        if status in ENDED:
            stream.write("\n")
            return status
        time.sleep(poll_s)


def progress_bar(progress: dict[str, Any]) -> str:
    total, done = progress.get("total"), progress.get("done", 0)
    if not total:
        return "waiting for a bulk worker (batchd bulk-worker)..."
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
    """Run the rq worker for bulk runs."""
    try:
        bulk_worker(
            _connection(settings),
            rq_queue_name=args.rq_queue,
            burst=args.burst,
            fork=not args.no_fork,
        )
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"batchd: cannot reach Redis: {exc}", file=sys.stderr)
        return 3
    return 0
