"""Bulk generation on rq: a JSONL of requests in, a JSONL of results out.

``batchd bulk IN --out OUT`` enqueues :func:`run_bulk` on the rq queue
``batchd-bulk`` (rq's JSON serializer, never pickle); ``batchd bulk-worker``
runs it. The run feeds every line of IN (a JobRequest, e.g. ``{"prompt": ...}``)
to the batchd queue with at most ``window`` jobs in flight and appends one
line per input to OUT: ``{"line": N, "id": ..., "text": ..., ...}`` or
``{"line": N, "error": ...}``, in completion order.

Resumable: a run reads OUT first and skips the lines already there. Job ids
are a hash of (input path, line number, line), and submits are idempotent,
so after a crash a line still running in the daemon is reattached to, not run
twice. OUT is locked (flock) while a run writes it: two runs never interleave.
Progress (done/total, tokens/s) is kept in the rq job's meta.
"""

from __future__ import annotations

import fcntl
import hashlib
import time
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import redis
from rq import Retry, get_current_job
from rq.job import Job

from batchd.config.limits import LimitSettings
from batchd.producers.bulk_worker import RQ_QUEUE, rq_queue
from batchd.producers.client import Client, follow
from batchd.producers.errors import BulkBusy, JobFailed, ValidationError
from batchd.producers.follow import Follower
from batchd.producers.gateway.batch_lines import custom_id_of, is_openai_line, openai_job
from batchd.producers.keys import DEFAULT_PREFIX, DEFAULT_QUEUE
from batchd.producers.result import ResultBuilder
from batchd.producers.schema import Event, JobRequest, validate_job

PROGRESS_EVERY_S = 0.5
# An rq worker killed mid-run leaves its job "started"; rq requeues it (abandoned
# job) after the worker's heartbeat lapses, this many times.
ABANDONED_RETRIES = 3


def line_job_id(input_path: Path, line_no: int, line: str) -> str:
    """The job id of one input line: the same line of the same file, the same id."""
    digest = hashlib.sha256(f"{input_path}\0{line_no}\0{line}".encode()).hexdigest()
    return f"bulk-{line_no}-{digest[:20]}"


def parse_line(
    line: str, *, input_path: Path, line_no: int, limits: LimitSettings | None = None
) -> tuple[JobRequest, dict[str, Any]]:
    """One input line as a JobRequest, and the fields its result line carries back (an
    OpenAI batch line's ``custom_id``, ``url`` and model); raises ValidationError."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValidationError("line", f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationError("line", f"expected a JSON object, got {type(data).__name__}")
    echo: dict[str, Any] = {}
    if is_openai_line(data):
        data, echo = openai_job(data)
    if data.get("id") is None:
        data["id"] = line_job_id(input_path, line_no, line)
    return validate_job(data, limits), echo


def input_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each non-blank line."""
    with path.open(encoding="utf-8") as source:
        for line_no, line in enumerate(source, start=1):
            if line.strip():
                yield line_no, line.rstrip("\n")


class ResultFile:
    """OUT, locked for appending; ``done`` holds the line numbers it already has, ``ids``
    the line each job id it names was given to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: IO[bytes] = path.open("a+b")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise BulkBusy(str(path)) from None
        self.file.seek(0)
        data = self.file.read()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):  # a line torn by a crash: it is redone
            self.file.truncate(whole)
        records = [orjson.loads(raw) for raw in data[:whole].splitlines() if raw]
        self.done = {int(record["line"]) for record in records}
        self.ids = {str(r["id"]): int(r["line"]) for r in records if r.get("id") is not None}

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(orjson.dumps(record) + b"\n")
        self.file.flush()

    def __enter__(self) -> ResultFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


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


def run_bulk(
    *,
    input_path: str,
    output_path: str,
    window: int = 64,
    queue: str = DEFAULT_QUEUE,
    prefix: str = DEFAULT_PREFIX,
    limits: dict[str, Any] | None = None,
    connection: redis.Redis | None = None,
    stop_key: str | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """The rq job: run every line of ``input_path``, append results to ``output_path``.

    Outside an rq worker, pass ``connection``. Once ``stop_key`` exists in Redis or
    the ``deadline`` (Unix time) has passed, the run submits no more lines and cancels
    the jobs in flight (they are written as cancelled). Returns the final progress.
    """
    rq_job = get_current_job()
    conn = connection if connection is not None else rq_job.connection if rq_job else None
    if conn is None:
        raise ValueError("run_bulk needs a Redis connection outside an rq worker")
    source = Path(input_path).resolve()
    limit_settings = LimitSettings.model_validate(limits) if limits else None
    client = Client(conn, prefix=prefix, queue=queue, limits=limit_settings)
    total = sum(1 for _ in input_lines(source))
    with ResultFile(Path(output_path)) as out:
        progress = Progress(total, len(out.done), rq_job)
        todo = ((n, line) for n, line in input_lines(source) if n not in out.done)
        stop = _Stop(conn, stop_key, deadline)
        run = _Window(client, todo, out, progress, source=source, window=window, stop=stop)
        run.fill()
        for job_id, event in follow(conn, run.follower):
            run.deliver(job_id, event)
        progress.report(force=True)
    return progress.as_dict()


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
    todo: Iterator[tuple[int, str]]
    out: ResultFile
    progress: Progress
    _: KW_ONLY
    source: Path
    window: int
    stop: _Stop
    stopped: bool = field(init=False, default=False)
    follower: Follower = field(init=False)
    # Each explicit id runs for one line only: a repeat would silently share its result.
    line_of: dict[str, int] = field(init=False)
    in_flight: dict[str, tuple[int, ResultBuilder, dict[str, Any]]] = field(
        init=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        self.follower = self.client.follower()
        self.line_of = dict(self.out.ids)

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

    def _submit(self, line_no: int, line: str) -> None:
        try:
            job, echo = parse_line(
                line, input_path=self.source, line_no=line_no, limits=self.client.limits
            )
            assert job.id is not None
            first = self.line_of.setdefault(job.id, line_no)
            if first != line_no:
                raise ValidationError("id", f"repeats the id of line {first}", value=job.id)
            handle = self.client.submit_request(job, idempotent=True)
        except ValidationError as exc:
            record = {"line": line_no, **custom_id_of(line), "error": str(exc), "field": exc.field}
            self._write(record, failed=True)
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


def enqueue_bulk(
    connection: redis.Redis,
    *,
    input_path: str | Path,
    output_path: str | Path,
    window: int = 64,
    queue: str = DEFAULT_QUEUE,
    prefix: str = DEFAULT_PREFIX,
    limits: LimitSettings | None = None,
    rq_queue_name: str = RQ_QUEUE,
) -> Job:
    """Enqueue a bulk run on rq; paths are made absolute (the worker's view of them)."""
    if window < 1:
        raise ValidationError("window", "must be at least 1", value=window)
    source = Path(input_path).resolve()
    if not source.is_file():
        raise ValidationError("input", f"{source} is not a file", value=str(input_path))
    target = Path(output_path).resolve()
    return rq_queue(connection, rq_queue_name).enqueue_call(
        "batchd.producers.bulk.run_bulk",
        kwargs={
            "input_path": str(source),
            "output_path": str(target),
            "window": window,
            "queue": queue,
            "prefix": prefix,
            "limits": None if limits is None else limits.model_dump(),
        },
        timeout=-1,  # a bulk run takes as long as it takes
        retry=Retry(max=ABANDONED_RETRIES),
        description=f"batchd bulk {source} -> {target}",
        meta={"progress": {"total": None, "done": 0}},
    )
