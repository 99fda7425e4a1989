"""Bulk generation on rq: a JSONL of requests in, a JSONL of results out.

``batchd bulk IN --out OUT`` copies IN into the bulk files folder
(:mod:`batchd.producers.bulk_files`) as ``<run>.input.jsonl``, makes OUT a link to
``<run>.output.jsonl`` there, and enqueues :func:`run_bulk` on the rq queue
``batchd-bulk`` (rq's JSON serializer, never pickle) naming the run alone: the
worker touches no path a job names. ``batchd bulk-worker`` runs it: every line
(a JobRequest, e.g. ``{"prompt": ...}``, or an OpenAI batch line) goes to the
batchd queue with at most ``window`` jobs in flight, and one line per input is
appended to the output: ``{"line": N, "id": ..., "text": ..., ...}`` or
``{"line": N, "error": ...}``, in completion order.

Resumable: the run name is a hash of (IN, OUT), a run reads its output first and
skips the lines already there. Job ids are a hash of (run, line number, line), and
submits are idempotent, so after a crash a line still running in the daemon is
reattached to, not run twice. The output is locked (flock) while a run writes it.
Progress (done/total, tokens/s) is kept in the rq job's meta.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import orjson
import redis
from rq import Retry
from rq.job import Job

from batchd.config.limits import LimitSettings
from batchd.producers.bulk_files import FilesDir
from batchd.producers.bulk_run import LineSource, deployment_connection, execute
from batchd.producers.bulk_worker import RQ_QUEUE, rq_queue
from batchd.producers.errors import ValidationError
from batchd.producers.gateway.batch_lines import custom_id_of, is_openai_line, openai_job
from batchd.producers.keys import DEFAULT_PREFIX, DEFAULT_QUEUE, check_name
from batchd.producers.schema import JobRequest, validate_job

# An rq worker killed mid-run leaves its job "started"; rq requeues it (abandoned
# job) after the worker's heartbeat lapses, this many times.
ABANDONED_RETRIES = 3
INPUT_SUFFIX = ".input.jsonl"
OUTPUT_SUFFIX = ".output.jsonl"


def run_name(source: Path, target: Path) -> str:
    """The run of IN -> OUT (absolute paths): the same files, the same run, so running
    ``batchd bulk`` again resumes it."""
    digest = hashlib.sha256(f"{source}\0{target}".encode()).hexdigest()
    return f"bulk-{digest[:24]}"


def line_job_id(run: str, line_no: int, line: str) -> str:
    """The job id of one input line: the same line of the same run, the same id."""
    digest = hashlib.sha256(f"{run}\0{line_no}\0{line}".encode()).hexdigest()
    return f"bulk-{line_no}-{digest[:20]}"


def parse_line(
    line: str, *, run: str, line_no: int, limits: LimitSettings | None = None
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
        data["id"] = line_job_id(run, line_no, line)
    return validate_job(data, limits), echo


class PlainLines(LineSource):
    """The lines of a ``batchd bulk`` run: job requests (or OpenAI batch lines), written
    by whoever ran ``batchd bulk``, a trusted producer: a line may name its job id.
    Each explicit id runs for one line only: a repeat would silently share its result."""

    key_id = None

    def __init__(self, run: str, limits: LimitSettings | None) -> None:
        self.run = run
        self.limits = limits
        self.line_of: dict[str, int] = {}

    def job(self, line_no: int, raw: bytes) -> tuple[JobRequest, dict[str, Any]]:
        try:
            line = raw.decode()
        except UnicodeDecodeError as exc:
            raise ValidationError("line", f"not UTF-8 (byte {exc.start})") from None
        job, echo = parse_line(line, run=self.run, line_no=line_no, limits=self.limits)
        assert job.id is not None
        first = self.line_of.setdefault(job.id, line_no)
        if first != line_no:
            raise ValidationError("id", f"repeats the id of line {first}", value=job.id)
        return job, echo

    def refused(self, line_no: int, raw: bytes, exc: ValidationError) -> dict[str, Any]:
        return {"line": line_no, **custom_id_of(raw), "error": str(exc), "field": exc.field}

    def remember(self, line_no: int, raw: bytes, record: dict[str, Any]) -> None:
        if record.get("id") is not None:
            self.line_of.setdefault(str(record["id"]), line_no)


def run_bulk(
    *,
    run: str,
    files_dir: str,
    window: int = 64,
    queue: str = DEFAULT_QUEUE,
    prefix: str = DEFAULT_PREFIX,
    limits: dict[str, Any] | None = None,
    connection: redis.Redis | None = None,
) -> dict[str, Any]:
    """The rq job of ``batchd bulk``: run ``<run>.input.jsonl`` of ``files_dir``, append
    results to ``<run>.output.jsonl`` there. Returns the final progress.

    ``files_dir`` is the worker's own (:class:`~batchd.producers.bulk_worker.BulkWorker`
    sets it; a job cannot). Outside an rq worker, pass ``connection``.
    """
    conn = deployment_connection("run_bulk", connection)
    check_name("run", run)
    settings = LimitSettings.model_validate(limits) if limits else None
    return execute(
        conn,
        FilesDir.at(files_dir),
        source=run + INPUT_SUFFIX,
        output=run + OUTPUT_SUFFIX,
        run=run,
        lines=PlainLines(run, settings),
        window=window,
        queue=queue,
        prefix=prefix,
        limits=settings,
    )


def stage_run(files: FilesDir, input_path: str | Path, output_path: str | Path) -> str:
    """Copy IN into the files folder as its run's input and make OUT a link to the run's
    output there; the run's name. Raises ValidationError (IN not a file, OUT taken)."""
    source = Path(input_path).resolve()
    if not source.is_file():
        raise ValidationError("input", f"{source} is not a file", value=str(input_path))
    target = Path(output_path).absolute()
    run = run_name(source, target)
    output = files.path(run + OUTPUT_SUFFIX)
    if os.path.lexists(target) and not (target.is_symlink() and target.readlink() == output):
        raise ValidationError(
            "out",
            f"{target} exists and is not this run's output (a link to {output}): bulk "
            "results are written in the bulk files folder; choose a new path",
            value=str(output_path),
        )
    files.write(run + INPUT_SUFFIX, source.read_bytes())
    if not os.path.lexists(target):
        target.symlink_to(output)
    return run


def enqueue_bulk(
    connection: redis.Redis,
    *,
    input_path: str | Path,
    output_path: str | Path,
    files_dir: str | Path,
    window: int = 64,
    queue: str = DEFAULT_QUEUE,
    prefix: str = DEFAULT_PREFIX,
    limits: LimitSettings | None = None,
    rq_queue_name: str = RQ_QUEUE,
) -> Job:
    """Stage a bulk run (:func:`stage_run`) and enqueue it on rq, naming the run only."""
    if window < 1:
        raise ValidationError("window", "must be at least 1", value=window)
    try:
        run = stage_run(FilesDir.at(files_dir), input_path, output_path)
    except OSError as exc:
        raise ValidationError("files_dir", f"cannot stage the run: {exc}") from None
    return rq_queue(connection, rq_queue_name).enqueue_call(
        "batchd.producers.bulk.run_bulk",
        kwargs={
            "run": run,
            "window": window,
            "queue": queue,
            "prefix": prefix,
            "limits": None if limits is None else limits.model_dump(),
        },
        timeout=-1,  # a bulk run takes as long as it takes
        retry=Retry(max=ABANDONED_RETRIES),
        description=f"batchd bulk {Path(input_path).name} -> {Path(output_path).name} ({run})",
        meta={"progress": {"total": None, "done": 0}, "run": run},
    )
