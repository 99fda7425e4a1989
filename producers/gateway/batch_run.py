"""The rq job of one OpenAI batch: batchd's bulk run, then the output and error files.

The bulk run (:func:`batchd.producers.bulk.run_bulk`) is what makes a batch
resumable: results are appended to ``<batch id>.results.jsonl`` as jobs end,
job ids are derived from the input lines and submits are idempotent, so a
killed worker, gateway or daemon costs no line twice (rq requeues an
abandoned job; the rerun skips what is done). Finalizing is idempotent too:
the output and error files have fixed ids and are rewritten whole.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import redis
from rq import get_current_job

from batchd.producers.bulk import input_lines, run_bulk
from batchd.producers.gateway.batch_lines import custom_id_of, output_line
from batchd.producers.gateway.store import (
    OWNER,
    batch_key,
    decode,
    encode,
    file_key,
    file_path,
    file_record,
    stop_key,
)
from batchd.producers.keys import Keys


def run_batch(
    *,
    batch_id: str,
    files_dir: str,
    queue: str,
    prefix: str,
    window: int,
    limits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the batch's input file through batchd; returns its request counts."""
    rq_job = get_current_job()
    assert rq_job is not None, "run_batch runs in an rq worker"
    conn: redis.Redis = rq_job.connection
    keys = Keys(prefix)
    key = batch_key(keys, batch_id)
    batch = decode(conn.hgetall(key))
    folder = Path(files_dir)
    results = folder / f"{batch_id}.results.jsonl"
    stopping = bool(conn.exists(stop_key(keys, batch_id)))
    if not stopping:
        _set(conn, key, status="in_progress", in_progress_at=batch.get("in_progress_at"))
    run_bulk(
        input_path=str(file_path(folder, batch["input_file_id"])),
        output_path=str(results),
        window=window,
        queue=queue,
        prefix=prefix,
        limits=limits,
        connection=conn,
        stop_key=stop_key(keys, batch_id),
        deadline=batch["expires_at"],
    )
    end = _ending(conn, keys, batch)
    if end == "completed":
        _set(conn, key, status="finalizing", finalizing_at=batch.get("finalizing_at"))
    source = file_path(folder, batch["input_file_id"])
    counts = finalize(conn, keys, batch, folder, results, source, expired=end == "expired")
    _set(conn, key, status=end, request_counts=counts, **{f"{end}_at": None})
    return counts


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
    folder: Path,
    results: Path,
    source: Path,
    *,
    expired: bool,
) -> dict[str, int]:
    """Write the output and error files (in input order) and record them on the batch.
    An expired batch's lines that never ran go to the error file as ``batch_expired``.
    The files belong to the batch's owner."""
    batch_id = batch["id"]
    records = [orjson.loads(raw) for raw in results.read_bytes().splitlines() if raw]
    lines_in = list(input_lines(source))
    if expired:
        done = {int(r["line"]) for r in records}
        records += [
            {"line": n, **custom_id_of(text), "error": "the batch expired", "code": "batch_expired"}
            for n, text in lines_in
            if n not in done
        ]
    records.sort(key=lambda r: int(r["line"]))
    created = int(time.time())
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
        file_path(folder, file_id).write_bytes(data)
        record = file_record(
            file_id,
            filename=f"{batch_id}_{suffix}.jsonl",
            size=len(data),
            purpose="batch_output",
            created_at=created,
        )
        stored = encode({**record, OWNER: batch.get(OWNER)})
        conn.hset(file_key(keys, file_id), mapping=stored)  # type: ignore[arg-type]
        ids[field] = file_id
    conn.hset(batch_key(keys, batch_id), mapping=encode(ids))  # type: ignore[arg-type]
    return {"total": len(lines_in), "completed": len(lines[True]), "failed": len(lines[False])}


def _set(conn: redis.Redis, key: str, **fields: Any) -> None:
    """Set fields on the batch; a timestamp field given as None means now (first time
    only: a rerun keeps the first value)."""
    now = int(time.time())
    values = {k: (now if v is None and k.endswith("_at") else v) for k, v in fields.items()}
    conn.hset(key, mapping=encode(values))  # type: ignore[arg-type]
