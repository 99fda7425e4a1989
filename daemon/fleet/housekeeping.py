"""Keeping a queue stream small: trim the entries every consumer is done with.

Trimming uses MINID at the oldest entry any group still needs (its oldest
pending one, else the first it has not been delivered), never MAXLEN, which could
drop an unacked job. Forgetting dead consumers is recovery's part
(:meth:`batchd.daemon.fleet.recovery.Recovery.forget_dead`): it shares the rule that says
who is dead.

An acked entry is not always a finished job. With AOF ``everysec`` a daemon can have
a job's end confirmed by a Redis that then crashes and loses it, and send the XACK to
the Redis that restarted: the ack stays, the end does not, and the job's status says
``running``. The entry then holds the only copy of the request, so trimming stops at
an entry whose job is not ended and names that entry: the daemon's durability watch
(batchd.daemon.fleet.durable) or, if that daemon died, the sweep
(batchd.daemon.fleet.sweep) enqueues it again; once it ends, trimming goes on.
"""

from __future__ import annotations

from typing import Any

import orjson
import redis

from batchd.producers.keys import JOB_FIELD, Keys, is_name
from batchd.producers.schema import JobState

# Entries one trim looks at (each one's status is read once, in one pipeline).
TRIM_BATCH = 1000
# A payload larger than this is not parsed for its id (the entry id then names the job).
ID_PARSE_BYTES = 1 << 20

_ENDED = {state.value.encode() for state in JobState if state.terminal}


def trim_acked(client: redis.Redis, stream: str, *, keys: Keys) -> int:
    """Delete up to TRIM_BATCH entries of ``stream`` that every consumer group is done
    with and whose jobs are not left running (see the module doc); returns how many.

    Every group counts, not only batchd's: another reader of the queue (an audit
    consumer, say) keeps what it has not read or acked. Safe without a
    transaction: entries below the computed bound were delivered and acked in
    every group, and a pending set only ever gains entries above its group's
    last-delivered id (or ones already pending).
    """
    groups: Any = client.xinfo_groups(stream)
    if not groups:
        return 0
    bounds = []
    for group in groups:
        pending: Any = client.xpending(stream, group["name"])
        bounds.append(
            _parse(pending["min"]) if pending["pending"] else _next(group["last-delivered-id"])
        )
    ms, seq = min(bounds)
    done: Any = client.xrange(stream, "-", f"({ms}-{seq}", count=TRIM_BATCH)
    if not done:
        return 0
    pipe = client.pipeline(transaction=False)
    for entry_id, fields in done:
        pipe.hmget(keys.job(_job_id(entry_id, fields)), "state", "entry")
    bound = _next(done[-1][0])
    for (entry_id, _), (state, entry) in zip(done, pipe.execute(), strict=True):
        if state is not None and state not in _ENDED and entry == entry_id:
            bound = _parse(entry_id)  # acked, its job not ended: the request stays
            break
    trimmed: int = client.xtrim(stream, minid=f"{bound[0]}-{bound[1]}", approximate=False)
    return trimmed


def _job_id(entry_id: bytes, fields: dict[bytes, bytes]) -> str:
    """The id the daemon files the entry's job under: the payload's, else the entry's."""
    payload = fields.get(JOB_FIELD.encode())
    if payload is not None and len(payload) <= ID_PARSE_BYTES:
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            data = None
        value = data.get("id") if isinstance(data, dict) else None
        if isinstance(value, str) and is_name(value):
            return value
    return entry_id.decode()


def _parse(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = text.split("-")
    return int(ms), int(seq)


def _next(entry_id: bytes) -> tuple[int, int]:
    ms, seq = _parse(entry_id)
    return ms, seq + 1
