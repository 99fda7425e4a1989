"""Batch API batches and bulk runs, with their progress and an ETA.

Both run as rq jobs on the bulk queue (``batchd-bulk``): a bulk run's progress is its rq
job's meta (``done``, ``total``, ``failed``, ``elapsed_s``, written every half second
by :class:`batchd.producers.bulk_run.Progress`); a Batch API batch is also a record in
Redis (``<prefix>:gateway:batch:<id>``, :mod:`batchd.producers.gateway.store`), whose
rq job has the batch's id. Read with rq's registries without their cleanup (which
would write), from a thread: rq is synchronous. The record's owner and secret are
never shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis
from rq import Worker
from rq.serializers import JSONSerializer

from batchd.producers.bulk_worker import rq_queue
from batchd.producers.gateway.store import PRIVATE, decode
from batchd.producers.keys import Keys

RECENT = 50
FUNCTIONS = {
    "batchd.producers.bulk.run_bulk": "bulk run",
    "batchd.producers.gateway.batch_run.run_batch": "batch",
}


@dataclass(frozen=True)
class Run:
    """One batch or bulk run. ``done`` counts lines answered (failed ones included)."""

    id: str
    kind: str
    status: str
    total: int | None
    done: int
    failed: int
    created_at: float | None
    elapsed_s: float | None
    tokens_per_s: float | None
    detail: str

    @property
    def fraction(self) -> float | None:
        return self.done / self.total if self.total else None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None when it cannot be told (or is over)."""
        if not self.total or not self.elapsed_s or self.done <= 0 or self.done >= self.total:
            return None
        return (self.total - self.done) / (self.done / self.elapsed_s)


@dataclass(frozen=True)
class BulkWorker:
    """A live ``batchd bulk-worker`` (rq's worker record, which rq expires when the
    worker stops beating)."""

    name: str
    state: str
    heartbeat_at: float | None
    current_job: str


def read_workers(conn: redis.Redis) -> list[BulkWorker]:
    """The rq workers of the bulk queue (blocking: call from a thread)."""
    workers = Worker.all(connection=conn, queue=rq_queue(conn))
    return sorted(
        (
            BulkWorker(
                name=str(w.name),
                state=str(w.get_state()),
                heartbeat_at=_timestamp(w.last_heartbeat),
                current_job=str(w.get_current_job_id() or ""),
            )
            for w in workers
        ),
        key=lambda w: w.name,
    )


def read_runs(conn: redis.Redis, keys: Keys) -> list[Run]:
    """Recent batches and bulk runs, newest first (blocking: call from a thread)."""
    runs = {run.id: run for run in _rq_runs(conn)}
    for record in _batch_records(conn, keys):
        run = _from_record(record, runs.get(str(record.get("id"))))
        runs[run.id] = run
    return sorted(runs.values(), key=lambda r: r.created_at or 0.0, reverse=True)[:RECENT]


def _rq_runs(conn: redis.Redis) -> list[Run]:
    queue = rq_queue(conn)
    ids = list(queue.get_job_ids(0, RECENT - 1))
    ids += queue.started_job_registry.get_job_ids(cleanup=False)
    for registry in (queue.finished_job_registry, queue.failed_job_registry):
        ids += registry.get_job_ids(0, RECENT - 1, desc=True, cleanup=False)
    jobs = queue.job_class.fetch_many(dict.fromkeys(ids), conn, serializer=JSONSerializer)
    return [_from_job(job) for job in jobs if job is not None]


def _from_job(job: Any) -> Run:
    progress = job.meta.get("progress") if isinstance(job.meta, dict) else None
    progress = progress if isinstance(progress, dict) else {}
    kwargs = job.kwargs if isinstance(job.kwargs, dict) else {}
    return Run(
        id=str(job.id),
        kind=FUNCTIONS.get(str(job.func_name), "rq job"),
        status=str(job.get_status(refresh=False) or "unknown"),
        total=_int(progress.get("total")),
        done=_int(progress.get("done")) or 0,
        failed=_int(progress.get("failed")) or 0,
        created_at=_timestamp(job.enqueued_at),
        elapsed_s=_float(progress.get("elapsed_s")),
        tokens_per_s=_float(progress.get("tokens_per_s")),
        detail=str(kwargs.get("run") or kwargs.get("queue") or ""),
    )


def _batch_records(conn: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """The newest batch records, found through each owner's index (a sorted set)."""
    indexes = list(conn.scan_iter(match=keys.gateway_batches_pattern, count=1000, _type="zset"))
    newest: list[tuple[float, bytes]] = []
    for index in indexes:
        members: Any = conn.zrevrange(index, 0, RECENT - 1, withscores=True)
        newest += [(score, member) for member, score in members]
    newest.sort(reverse=True)
    with conn.pipeline(transaction=False) as pipe:
        for _, batch_id in newest[:RECENT]:
            pipe.hgetall(keys.gateway_batch(batch_id.decode(errors="replace")))
        raws = pipe.execute(raise_on_error=False)
    records = []
    for raw in raws:
        if isinstance(raw, dict) and raw:
            record = decode(raw)
            for name in PRIVATE:
                record.pop(name, None)
            records.append(record)
    return records


def _from_record(record: dict[str, Any], running: Run | None) -> Run:
    counts = record.get("request_counts") or {}
    live = running is not None and running.total is not None
    return Run(
        id=str(record.get("id")),
        kind="batch",
        status=str(record.get("status") or "unknown"),
        total=running.total if live and running else _int(counts.get("total")),
        done=running.done
        if live and running
        else (_int(counts.get("completed")) or 0) + (_int(counts.get("failed")) or 0),
        failed=running.failed if live and running else _int(counts.get("failed")) or 0,
        created_at=_float(record.get("created_at")),
        elapsed_s=running.elapsed_s if running else None,
        tokens_per_s=running.tokens_per_s if running else None,
        detail=str(record.get("endpoint") or ""),
    )


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _timestamp(value: Any) -> float | None:
    """rq's datetimes are UTC, naive in some versions."""
    if not isinstance(value, datetime):
        return None
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
