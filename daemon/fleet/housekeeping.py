"""Keeping a queue stream small: trim the entries every consumer is done with.

Trimming uses MINID at the oldest entry any group still needs (its oldest
pending one, else the first it has not been delivered), never MAXLEN, which could
drop an unacked job. Forgetting dead consumers is recovery's part
(:meth:`batchd.daemon.fleet.recovery.Recovery.forget_dead`): it shares the rule that says
who is dead.
"""

from __future__ import annotations

from typing import Any

import redis


def trim_acked(client: redis.Redis, stream: str) -> int:
    """Delete entries of ``stream`` every consumer group is done with; returns how many.

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
    trimmed: int = client.xtrim(stream, minid=f"{ms}-{seq}", approximate=False)
    return trimmed


def _parse(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = text.split("-")
    return int(ms), int(seq)


def _next(entry_id: bytes) -> tuple[int, int]:
    ms, seq = _parse(entry_id)
    return ms, seq + 1
