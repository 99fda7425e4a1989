"""The rq job of one OpenAI batch: batchd's bulk run, then the output and error files.

The bulk run (:func:`batchd.producers.bulk_run.execute`) is what makes a batch
resumable: results are appended to ``<batch id>.results.jsonl`` as jobs end,
job ids are derived from the lines (under the batch's secret) and submits are
idempotent, so a killed worker, gateway or daemon costs no line twice (rq requeues
an abandoned job; the rerun skips what is done). Finalizing is idempotent too:
the output and error files have fixed ids and are rewritten whole.

Every file is a name in the worker's own folder (``files_dir``, set by the worker),
derived from the batch: its input file's id, its own id. A whole-batch problem that
no retry can mend (the input file is gone or unreadable, or fails OpenAI's validation:
:func:`~batchd.producers.gateway.batch_lines.validation_errors`) fails the batch at
once, with the reasons in its ``errors``, instead of after rq's retries.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
import redis

from batchd.config.limits import LimitSettings
from batchd.producers.bulk_files import FilesDir
from batchd.producers.bulk_run import deployment_connection, execute, input_lines
from batchd.producers.errors import UnsafePath
from batchd.producers.gateway.batch_lines import (
    BatchLines,
    ServedModels,
    custom_id_of,
    output_line,
    validation_errors,
)
from batchd.producers.gateway.fleet import served_models
from batchd.producers.gateway.store import (
    DEFAULT_EXPIRY_S,
    OUTPUT_LIFETIME,
    OWNER,
    SECRET,
    TERMINAL,
    batch_key,
    decode,
    encode,
    expiring,
    file_index,
    file_key,
    file_name,
    file_record,
    stop_key,
)
from batchd.producers.keys import Keys, check_name

log = logging.getLogger(__name__)
FLEET_POLL_S = 1.0


def run_batch(
    *,
    batch_id: str,
    files_dir: str,
    queue: str,
    prefix: str,
    window: int,
    limits: dict[str, Any] | None = None,
    default_max_tokens: int | None = None,
) -> dict[str, Any]:
    """Run the batch's input file through batchd; returns its request counts.
    ``files_dir`` is the worker's own (a job cannot name one); a chat line without
    max_tokens gets ``default_max_tokens`` (the gateway's)."""
    # The batch's records, files and jobs are the deployment's, which on a Cluster is
    # not rq's Redis.
    conn = deployment_connection("run_batch")
    keys = Keys(prefix)
    check_name("batch_id", batch_id)
    key = batch_key(keys, batch_id)
    batch = decode(conn.hgetall(key))
    if not batch:
        raise ValueError(f"batch {batch_id} has no record (expired or never created)")
    if batch.get("status") in TERMINAL:  # run again (a retry, a stray enqueue): done already
        return dict(batch.get("request_counts") or {})
    files = FilesDir.at(files_dir)
    input_id = str(batch["input_file_id"])
    source = file_name(input_id)
    try:
        if not conn.exists(file_key(keys, input_id)) or not files.exists(source):
            raise FileNotFoundError(f"file {input_id} was deleted or has expired")
        with files.open(source) as src:
            faults = validation_errors(input_lines(src), batch["endpoint"])
    except (UnsafePath, OSError) as exc:
        return _fail(conn, key, [_error("input_file_unavailable", f"cannot be read: {exc}")])
    if faults:
        return _fail(conn, key, faults)
    stopping = bool(conn.exists(stop_key(keys, batch_id)))
    if not stopping:
        _set(conn, key, status="in_progress", in_progress_at=batch.get("in_progress_at"))
    settings = LimitSettings.model_validate(limits) if limits else None
    models = ServedModels(lambda: served_models(conn, keys, queue))
    _wait_for_fleet(conn, keys, batch, models)
    lines = BatchLines(
        endpoint=batch["endpoint"],
        secret=batch[SECRET],
        key_id=batch[OWNER],
        models=models,
        limits=settings,
        default_max_tokens=default_max_tokens,
    )
    results = f"{batch_id}.results.jsonl"
    try:
        execute(
            conn,
            files,
            source=source,
            output=results,
            run=batch_id,
            lines=lines,
            window=window,
            queue=queue,
            prefix=prefix,
            limits=settings,
            stop_key=stop_key(keys, batch_id),
            deadline=batch["expires_at"],
        )
        end = _ending(conn, keys, batch)
        if end == "completed":
            _set(conn, key, status="finalizing", finalizing_at=batch.get("finalizing_at"))
        counts = finalize(conn, keys, batch, files, results, source, expired=end == "expired")
    except FileNotFoundError as exc:  # the input was deleted while the batch ran
        return _fail(conn, key, [_error("input_file_unavailable", f"is gone: {exc}")])
    _set(conn, key, status=end, request_counts=counts, **{f"{end}_at": None})
    return counts


def _wait_for_fleet(
    conn: redis.Redis, keys: Keys, batch: dict[str, Any], models: ServedModels
) -> None:
    """Wait (as a job waits on its queue) until a live daemon serves the queue, so a
    fleet restarting does not fail every line as naming an unserved model; no wait once
    the batch is cancelled or past its window."""
    while True:
        models.names, models.read_at = models.read(), time.monotonic()
        if models.names or time.time() > batch["expires_at"]:
            return
        if conn.exists(stop_key(keys, batch["id"])):
            return
        time.sleep(FLEET_POLL_S)


def _ending(conn: redis.Redis, keys: Keys, batch: dict[str, Any]) -> str:
    """How a finished run ends: ``expired`` past the completion window, ``cancelled``
    when asked to stop, else ``completed``."""
    if time.time() > batch["expires_at"]:
        return "expired"
    return "cancelled" if conn.exists(stop_key(keys, batch["id"])) else "completed"


def finalize(
    conn: redis.Redis,
    keys: Keys,
    batch: dict[str, Any],
    files: FilesDir,
    results: str,
    source: str,
    *,
    expired: bool,
) -> dict[str, int]:
    """Write the output and error files (in input order) and record them on the batch.
    An expired batch's lines that never ran go to the error file as ``batch_expired``.
    The files belong to the batch's owner and expire as the batch asked
    (``output_expires_after``)."""
    batch_id = batch["id"]
    records = [orjson.loads(raw) for raw in files.read(results).splitlines() if raw]
    with files.open(source) as src:
        lines_in = list(input_lines(src))
    if expired:
        done = {int(r["line"]) for r in records}
        records += [
            {"line": n, **custom_id_of(raw), "error": "the batch expired", "code": "batch_expired"}
            for n, raw in lines_in
            if n not in done
        ]
    records.sort(key=lambda r: int(r["line"]))
    created = int(time.time())
    lifetime = int(batch.get(OUTPUT_LIFETIME) or DEFAULT_EXPIRY_S)
    lines: dict[bool, list[bytes]] = {True: [], False: []}
    for record in records:
        ok, line = output_line(record, created=created)
        lines[ok].append(orjson.dumps(line))
    ids: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
    for ok, field, suffix in (
        (True, "output_file_id", "output"),
        (False, "error_file_id", "errors"),
    ):
        if not lines[ok]:
            continue
        file_id = f"file-{batch_id}-{suffix}"
        data = b"\n".join(lines[ok]) + b"\n"
        files.write(file_name(file_id), data)
        record = file_record(
            file_id,
            filename=f"{batch_id}_{suffix}.jsonl",
            size=len(data),
            purpose="batch_output",
            created_at=created,
            expires_at=created + lifetime,
        )
        stored = encode({**record, OWNER: batch.get(OWNER)})
        conn.hset(file_key(keys, file_id), mapping=stored)  # type: ignore[arg-type]
        conn.expireat(file_key(keys, file_id), created + lifetime)
        conn.zadd(expiring(keys), {file_name(file_id): created + lifetime})
        conn.zadd(file_index(keys, batch[OWNER]), {file_id: time.time()})
        ids[field] = file_id
    conn.zadd(expiring(keys), {results: created + lifetime})
    conn.hset(batch_key(keys, batch_id), mapping=encode(ids))  # type: ignore[arg-type]
    return {"total": len(lines_in), "completed": len(lines[True]), "failed": len(lines[False])}


def _error(code: str, why: str) -> dict[str, Any]:
    """An ``errors.data`` entry about the input file as a whole."""
    return {"code": code, "message": f"the input file {why}", "param": None, "line": None}


def _fail(conn: redis.Redis, key: str, errors: list[dict[str, Any]]) -> dict[str, Any]:
    """End the batch ``failed`` now, with OpenAI's ``errors`` list (no rq retry: none
    could mend it); no request ran."""
    log.warning("batch %s failed: %s", key, errors[0]["message"])
    _set(conn, key, status="failed", errors={"object": "list", "data": errors}, failed_at=None)
    return {"total": 0, "completed": 0, "failed": 0}


def _set(conn: redis.Redis, key: str, **fields: Any) -> None:
    """Set fields on the batch; a timestamp field given as None means now (first time
    only: a rerun keeps the first value)."""
    now = int(time.time())
    values = {k: (now if v is None and k.endswith("_at") else v) for k, v in fields.items()}
    conn.hset(key, mapping=encode(values))  # type: ignore[arg-type]
