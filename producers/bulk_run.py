"""One bulk run: lines in, at most ``window`` jobs in flight, one result line out per line.

Shared by ``batchd bulk`` (:mod:`batchd.producers.bulk`) and the Batch API's runner
(:mod:`batchd.producers.gateway.batch_run`); what a line may say and whose jobs it makes
is the :class:`LineSource`'s to decide. Every line is judged alone: one that does not
decode, parse or validate becomes one error record and the others run.

A run's batchd jobs go to the deployment's Redis, which need not be rq's: on Redis
Cluster rq has a Redis of its own (``bulk.rq_redis_url``), so the worker names the
deployment's connection to the runs it performs (:func:`deployment`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import KW_ONLY, dataclass, field
from typing import IO, Any

import redis
from rq import get_current_job
from rq.job import Job

from batchd.config.limits import LimitSettings
from batchd.producers.bulk_files import FilesDir, ResultFile
from batchd.producers.client import Client, follow
from batchd.producers.errors import JobFailed, ValidationError
from batchd.producers.follow import Follower
from batchd.producers.result import ResultBuilder
from batchd.producers.schema import Event, JobRequest

PROGRESS_EVERY_S = 0.5
MAX_WINDOW = 4096

# The deployment's Redis, named by the worker performing a run (see the module doc).
_DEPLOYMENT: ContextVar[redis.Redis | None] = ContextVar("batchd_deployment", default=None)


@contextmanager
def deployment(conn: redis.Redis | None) -> Iterator[None]:
    """Within this block, runs send their batchd jobs to ``conn`` (None: to rq's Redis)."""
    token = _DEPLOYMENT.set(conn)
    try:
        yield
    finally:
        _DEPLOYMENT.reset(token)


def deployment_connection(what: str, connection: redis.Redis | None = None) -> redis.Redis:
    """The Redis the batchd jobs of the run ``what`` go to: ``connection`` when given,
    else the one the worker named (:func:`deployment`), else the rq job's own."""
    if connection is not None:
        return connection
    named = _DEPLOYMENT.get()
    if named is not None:
        return named
    rq_job = get_current_job()
    if rq_job is None:
        raise ValueError(f"{what} needs a Redis connection outside an rq worker")
    conn: redis.Redis = rq_job.connection
    return conn


class LineSource(ABC):
    """What the lines of a run may say: each becomes a job, or an error record.

    ``key_id`` owns every job the run makes (None: a raw producer's run); an idempotent
    submit attaches only to a job of the same key.
    """

    key_id: str | None = None

    @abstractmethod
    def job(self, line_no: int, raw: bytes) -> tuple[JobRequest, dict[str, Any]]:
        """The job of a line and what its result record echoes; ValidationError if bad."""

    @abstractmethod
    def refused(self, line_no: int, raw: bytes, exc: ValidationError) -> dict[str, Any]:
        """The error record of a line refused with ``exc``."""

    @abstractmethod
    def remember(self, line_no: int, raw: bytes, record: dict[str, Any]) -> None:
        """A line a previous attempt already wrote (``record``): what later lines must
        know of it (an id or custom_id they may not repeat)."""


def input_lines(source: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each non-blank line, from the start."""
    source.seek(0)
    for line_no, line in enumerate(source, start=1):
        if line.strip():
            yield line_no, line.rstrip(b"\r\n")


class Progress:
    """Counters of a run, reported to the rq job's meta at most every PROGRESS_EVERY_S."""

    def __init__(self, total: int, done: int, job: Job | None) -> None:
        self.total = total
        self.done = done
        self.failed = 0
        self.tokens = 0
        self.started = time.monotonic()
        self.job = job
        self.reported = -PROGRESS_EVERY_S

    def as_dict(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        return {
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
            "tokens": self.tokens,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(self.tokens / elapsed, 1) if elapsed > 0 else 0.0,
        }

    def report(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.job is None or (not force and now - self.reported < PROGRESS_EVERY_S):
            return
        self.reported = now
        self.job.meta["progress"] = self.as_dict()
        self.job.save_meta()


def execute(
    conn: redis.Redis,
    files: FilesDir,
    *,
    source: str,
    output: str,
    run: str,
    lines: LineSource,
    window: int,
    queue: str,
    prefix: str,
    limits: LimitSettings | None,
    stop_key: str | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Run every line of ``source`` (a name in ``files``), appending records to
    ``output`` (created for ``run``, or this run's own). Once ``stop_key`` exists in
    Redis or the ``deadline`` (Unix time) has passed, no more lines are submitted and
    the jobs in flight are cancelled (written as cancelled). Returns the progress."""
    if not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
        raise ValidationError("window", f"must be an integer from 1 to {MAX_WINDOW}", value=window)
    client = Client(conn, prefix=prefix, queue=queue, limits=limits)
    with files.open(source) as src, ResultFile(files, output, run=run) as out:
        total = sum(1 for _ in input_lines(src))
        progress = Progress(total, len(out.done), get_current_job())
        todo = _todo(input_lines(src), out, lines)
        stop = _Stop(conn, stop_key, deadline)
        batch = _Window(client, todo, out, progress, lines=lines, window=window, stop=stop)
        batch.fill()
        for job_id, event in follow(conn, batch.follower):
            batch.deliver(job_id, event)
        progress.report(force=True)
    return progress.as_dict()


def _todo(
    items: Iterable[tuple[int, bytes]], out: ResultFile, lines: LineSource
) -> Iterator[tuple[int, bytes]]:
    """The lines still to run, in order; the ones done are remembered as they pass."""
    written = {int(record["line"]): record for record in out.records}
    for line_no, raw in items:
        if line_no in written:
            lines.remember(line_no, raw, written[line_no])
        else:
            yield line_no, raw


@dataclass(eq=False)
class _Stop:
    """When a run must stop: its stop key exists (read at most every PROGRESS_EVERY_S)
    or its deadline has passed."""

    conn: redis.Redis
    key: str | None
    deadline: float | None
    checked: float = field(init=False, default=-PROGRESS_EVERY_S)

    def due(self) -> bool:
        if self.deadline is not None and time.time() > self.deadline:
            return True
        now = time.monotonic()
        if self.key is None or now - self.checked < PROGRESS_EVERY_S:
            return False
        self.checked = now
        return bool(self.conn.exists(self.key))


@dataclass(eq=False)
class _Window:
    """The jobs of a run in flight: at most ``window`` at once, refilled as each ends,
    so a million-line file never floods the batchd queue."""

    client: Client
    todo: Iterator[tuple[int, bytes]]
    out: ResultFile
    progress: Progress
    _: KW_ONLY
    lines: LineSource
    window: int
    stop: _Stop
    stopped: bool = field(init=False, default=False)
    follower: Follower = field(init=False)
    in_flight: dict[str, tuple[int, ResultBuilder, dict[str, Any]]] = field(
        init=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        self.follower = self.client.follower()

    def should_stop(self) -> bool:
        """Whether the run must stop; when it first must, every job in flight is cancelled."""
        if not self.stopped and self.stop.due():
            self.stopped = True
            for job_id in list(self.in_flight):
                self.client.cancel(job_id)
        return self.stopped

    def fill(self) -> None:
        """Submit lines until the window is full, the input is used up or the run stops."""
        while self.follower.active < self.window and not self.should_stop():
            item = next(self.todo, None)
            if item is None:
                return
            self._submit(*item)

    def _submit(self, line_no: int, raw: bytes) -> None:
        try:
            job, echo = self.lines.job(line_no, raw)
            handle = self.client.submit_request(job, idempotent=True, key_id=self.lines.key_id)
        except ValidationError as exc:
            self._write(self.lines.refused(line_no, raw, exc), failed=True)
            return
        self.follower.add(handle.id)
        self.in_flight[handle.id] = (line_no, ResultBuilder(handle.id), echo)

    def deliver(self, job_id: str, event: Event) -> None:
        """One event of a job in flight; when it ends, its result line is written and
        the window refilled."""
        line_no, builder, echo = self.in_flight[job_id]
        self.progress.tokens += event.token_id is not None
        try:
            result = builder.add(event)
        except JobFailed as exc:
            error = {"line": line_no, **echo, "id": job_id, "error": str(exc), "reason": exc.reason}
            if exc.error:
                error["detail"] = exc.error
            self._write(error, failed=True)
        else:
            if result is None:
                self.progress.report()
                self.should_stop()
                return
            self._write({"line": line_no, **echo, **result.to_dict()}, failed=False)
        del self.in_flight[job_id]
        self.fill()

    def _write(self, record: dict[str, Any], *, failed: bool) -> None:
        self.out.write(record)
        self.progress.done += 1
        self.progress.failed += failed
        self.progress.report()
