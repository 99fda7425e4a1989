"""Finding jobs by id (or its start), state, queue and a metadata field.

Redis keeps no index of jobs, and the dashboard adds none: a search walks the status
hashes with SCAN (server-side MATCH on the id prefix, TYPE hash), a bounded number of
steps per request, and hands back SCAN's cursor so that "more" continues where it
stopped. Results come in SCAN's order, not by time. A metadata field is matched where
Redis still holds it: an ended job's final event, a running job's queue entry; a
queued job's request is read only for an exact id (its own page), so a metadata
search does not see queued jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from batchd.producers.connection import is_cluster
from batchd.producers.keys import EVENT_FIELD, JOB_FIELD, Keys, is_name

FIELDS = ("state", "queue", "queued_at", "finished_at", "completion_tokens", "daemon", "error")
SCAN_COUNT = 1000
ENDED = frozenset({"finished", "failed", "cancelled", "expired"})


@dataclass(frozen=True)
class JobQuery:
    """What to look for; empty fields match everything. ``meta`` is ``key=value``."""

    id: str = ""
    state: str = ""
    queue: str = ""
    meta: str = ""

    @property
    def meta_pair(self) -> tuple[str, str] | None:
        key, eq, value = self.meta.partition("=")
        return (key.strip(), value.strip()) if eq and key.strip() else None

    @property
    def empty(self) -> bool:
        return not (self.id or self.state or self.queue or self.meta)


@dataclass(frozen=True)
class JobRow:
    id: str
    state: str
    queue: str
    queued_at: float | None
    finished_at: float | None
    completion_tokens: str
    daemon: str
    error: str


@dataclass(frozen=True)
class SearchPage:
    """Rows found; ``cursor`` continues the walk (0: the keyspace is walked)."""

    rows: list[JobRow]
    cursor: int
    steps: int


async def search(
    client: aioredis.Redis,
    keys: Keys,
    query: JobQuery,
    *,
    cursor: int = 0,
    max_keys: int = 20_000,
    limit: int = 50,
) -> SearchPage:
    """Up to ``limit`` matching jobs, walking at most about ``max_keys`` keys. On a
    Redis Cluster, whose SCAN cursor is one per node, an exact id only."""
    rows: list[JobRow] = []
    if cursor == 0 and is_name(query.id):
        rows += await _matching(client, keys, query, [keys.job(query.id)])
    if is_cluster(client):
        return SearchPage(rows[:limit], 0, 0)
    pattern = keys.job_pattern(query.id)
    steps = 0
    seen = {row.id for row in rows}
    while steps * SCAN_COUNT < max_keys and len(rows) < limit:
        reply: Any = await client.scan(cursor, match=pattern, count=SCAN_COUNT, _type="hash")
        cursor, found = reply
        steps += 1
        names = [k.decode(errors="replace") for k in found]
        fresh = [name for name in names if name.rpartition(":")[2] not in seen]
        for row in await _matching(client, keys, query, fresh):
            if row.id not in seen:
                seen.add(row.id)
                rows.append(row)
        if cursor == 0:
            break
    return SearchPage(rows[:limit], cursor, steps)


async def _matching(
    client: aioredis.Redis, keys: Keys, query: JobQuery, names: list[str]
) -> list[JobRow]:
    if not names:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hmget(name, FIELDS)
        replies = await pipe.execute(raise_on_error=False)
    rows = []
    for name, values in zip(names, replies, strict=True):
        job_id = name.rpartition(":job:")[2]  # whatever the partition's tag
        if not isinstance(values, list) or values[0] is None or not is_name(job_id):
            continue
        row = _row(job_id, values)
        if query.state and row.state != query.state:
            continue
        if query.queue and row.queue != query.queue:
            continue
        rows.append(row)
    pair = query.meta_pair
    if pair is None:
        return rows
    metas = await _metadata(client, keys, rows)
    return [row for row, meta in zip(rows, metas, strict=True) if _has(meta, *pair)]


async def _metadata(
    client: aioredis.Redis, keys: Keys, rows: list[JobRow]
) -> list[dict[str, Any] | None]:
    """Each row's metadata where Redis still holds it (final event, or queue entry)."""
    async with client.pipeline(transaction=False) as pipe:
        for row in rows:
            if row.state in ENDED:
                pipe.xrevrange(keys.events(row.id), count=1)
            else:
                pipe.hmget(keys.job(row.id), ["queue", "entry"])
        replies = await pipe.execute(raise_on_error=False)
    out: list[dict[str, Any] | None] = []
    entries: list[tuple[int, str, str]] = []
    for i, (row, reply) in enumerate(zip(rows, replies, strict=True)):
        out.append(None)
        if row.state in ENDED and isinstance(reply, list) and reply:
            out[i] = _meta_of(reply[0][1].get(EVENT_FIELD.encode()))
        elif isinstance(reply, list) and reply[0] and reply[1] and is_name(reply[0].decode()):
            entries.append((i, reply[0].decode(), reply[1].decode()))
    if entries:
        async with client.pipeline(transaction=False) as pipe:
            for i, queue, entry in entries:
                stream = keys.queue_for(queue, rows[i].id)
                pipe.xrange(stream, min=entry, max=entry, count=1)
            found = await pipe.execute(raise_on_error=False)
        for (i, _, _), reply in zip(entries, found, strict=True):
            if isinstance(reply, list) and reply:
                out[i] = _meta_of(reply[0][1].get(JOB_FIELD.encode()))
    return out


def _meta_of(payload: bytes | None) -> dict[str, Any] | None:
    if not payload:
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    meta = data.get("metadata") if isinstance(data, dict) else None
    return meta if isinstance(meta, dict) else None


def _has(meta: dict[str, Any] | None, key: str, value: str) -> bool:
    """Whether metadata holds ``key`` with ``value`` (compared as text: ``n=3`` finds 3)."""
    if meta is None or key not in meta:
        return False
    held = meta[key]
    return (held if isinstance(held, str) else orjson.dumps(held).decode()) == value


def _row(job_id: str, values: list[Any]) -> JobRow:
    text = [v.decode(errors="replace") if v is not None else "" for v in values]
    state, queue, queued, finished, tokens, daemon, error = text
    return JobRow(job_id, state, queue, _float(queued), _float(finished), tokens, daemon, error)


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
