"""Where the Batch API keeps its files and batches: bytes on disk, records in Redis.

A file's bytes live in ``files_dir/<file id>.jsonl`` (the gateway and the bulk
worker must share that directory: same host or a shared mount), its record in
the hash ``<prefix>:gateway:file:<id>``. A batch is the hash
``<prefix>:gateway:batch:<id>`` (the OpenAI batch object's fields, JSON-encoded
values) and runs as the rq job of the same id; ``<prefix>:gateway:batch:<id>:stop``
exists once it is cancelled. Sync and async code share these names and shapes.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson

from batchd.producers.keys import Keys

BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "cancelling",
    "cancelled",
    "expired",
)
TERMINAL = {"completed", "failed", "cancelled", "expired"}
# Hash field of a file's or batch's owner (a key digest, see Guard.owner); never answered.
OWNER = "owner"


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def file_key(keys: Keys, file_id: str) -> str:
    return f"{keys.prefix}:gateway:file:{file_id}"


def batch_key(keys: Keys, batch_id: str) -> str:
    return f"{keys.prefix}:gateway:batch:{batch_id}"


def batch_index(keys: Keys, owner: str | None) -> str:
    """Sorted set of one owner's batch ids by creation time (for ``GET /v1/batches``)."""
    return f"{keys.prefix}:gateway:batches" + (f":{owner}" if owner else "")


def stop_key(keys: Keys, batch_id: str) -> str:
    return f"{batch_key(keys, batch_id)}:stop"


def file_path(files_dir: Path, file_id: str) -> Path:
    return files_dir / f"{file_id}.jsonl"


def file_record(
    file_id: str, *, filename: str, size: int, purpose: str, created_at: int
) -> dict[str, Any]:
    """An OpenAI file object."""
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
    }


def encode(record: dict[str, Any]) -> dict[str, bytes]:
    """A record as hash fields (each value JSON, so None and numbers survive)."""
    return {k: orjson.dumps(v) for k, v in record.items()}


def owned(raw: dict[Any, Any], owner: str | None) -> dict[str, Any] | None:
    """The record without its owner field, or None when it is not ``owner``'s."""
    record = decode(raw)
    return record if record.pop(OWNER, None) == owner else None


def decode(raw: dict[Any, Any]) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else k): orjson.loads(v) for k, v in raw.items()}
