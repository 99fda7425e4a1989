"""Where the Batch API keeps its files and batches: bytes on disk, records in Redis.

A file's bytes live in ``files_dir/<file id>.jsonl`` (the bulk files folder, which the
gateway and the bulk worker share: same host or a shared mount), its record in the hash
``<prefix>:gateway:file:<id>``, its id in its owner's index
``<prefix>:gateway:files:<owner>`` (for listing). A batch is the hash
``<prefix>:gateway:batch:<id>`` (the OpenAI batch object's fields, JSON-encoded values)
and runs as the rq job of the same id; ``<prefix>:gateway:batch:<id>:stop`` exists once
it is cancelled.

Every record carries its owner, the key id of the API key that made it (a digest, never
the key), and a batch its secret (which makes its jobs' ids unguessable); neither is
ever answered. Ids are random (``secrets``), so no key can guess another's. Files expire
(OpenAI's ``expires_after``: 30 days for batch files unless asked otherwise): their
record has a Redis TTL, their bytes are listed in ``<prefix>:gateway:expiring`` for the
sweep (:mod:`batchd.producers.gateway.expiry`). Sync and async code share these.
"""

from __future__ import annotations

import hashlib
import re
import secrets
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
# Hash fields never answered: a record's owner (a key id), a batch's secret, and how
# long its output files live.
OWNER = "owner"
SECRET = "secret"
OUTPUT_LIFETIME = "output_expires_after_s"
PRIVATE = (OWNER, SECRET, OUTPUT_LIFETIME)
# The key id of every caller of a gateway without API keys (everything is shared then).
OPEN_KEY_ID = "open"
# OpenAI's bounds of expires_after.seconds (1 hour to 30 days), and the default for
# batch files and batch outputs.
MIN_EXPIRY_S = 3600
MAX_EXPIRY_S = 30 * 24 * 3600
DEFAULT_EXPIRY_S = MAX_EXPIRY_S
# A batch's record outlives its 24 h window by this much (then its id answers 404).
BATCH_RECORD_TTL_S = MAX_EXPIRY_S


_RECORD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def is_record_id(text: str) -> bool:
    """Whether ``text`` can be a file or batch id (no ``:``: an id never names another
    key, such as a batch's stop key); anything else is answered 404 unread."""
    return _RECORD_ID.fullmatch(text) is not None


def key_id(api_key: str) -> str:
    """The id stored for an API key: a digest, so Redis never holds the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


def new_id(kind: str) -> str:
    """A fresh, unguessable id (128 random bits)."""
    return f"{kind}-{secrets.token_hex(16)}"


def new_secret() -> str:
    return secrets.token_hex(32)


def file_key(keys: Keys, file_id: str) -> str:
    return keys.gateway_file(file_id)


def batch_key(keys: Keys, batch_id: str) -> str:
    return keys.gateway_batch(batch_id)


def batch_index(keys: Keys, owner: str) -> str:
    """Sorted set of one owner's batch ids by creation time (for ``GET /v1/batches``)."""
    return keys.gateway_batches(owner)


def file_index(keys: Keys, owner: str) -> str:
    """Sorted set of one owner's file ids (inputs and batch outputs) by creation time, for
    ``GET /v1/files``: entries leave on delete, and when read after their record expired."""
    return keys.gateway_files(owner)


def expiring(keys: Keys) -> str:
    """Sorted set of file names in the files folder, by the Unix time they expire."""
    return keys.gateway_expiring


def stop_key(keys: Keys, batch_id: str) -> str:
    return f"{batch_key(keys, batch_id)}:stop"


def file_name(file_id: str) -> str:
    """The name of a file's bytes in the files folder."""
    return f"{file_id}.jsonl"


def file_record(
    file_id: str,
    *,
    filename: str,
    size: int,
    purpose: str,
    created_at: int,
    expires_at: int | None,
) -> dict[str, Any]:
    """An OpenAI file object."""
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "expires_at": expires_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
    }


def encode(record: dict[str, Any]) -> dict[str, bytes]:
    """A record as hash fields (each value JSON, so None and numbers survive)."""
    return {k: orjson.dumps(v) for k, v in record.items()}


def owned(raw: dict[Any, Any], owner: str) -> dict[str, Any] | None:
    """The record without its private fields, or None when there is none or it is not
    ``owner``'s (the caller answers both with the same 404)."""
    if not raw:
        return None
    record = decode(raw)
    if record.get(OWNER) != owner or "id" not in record:
        return None
    for name in PRIVATE:
        record.pop(name, None)
    return record


def decode(raw: dict[Any, Any]) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else k): orjson.loads(v) for k, v in raw.items()}
