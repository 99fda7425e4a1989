"""Keeping a queue stream small: trim the entries every consumer is done with.

Trimming uses MINID at the oldest entry the group still needs (the oldest
pending one, else the first not yet delivered), never MAXLEN, which could
drop an unacked job. Forgetting dead consumers is recovery's part
(:meth:`daemon.fleet.recovery.Recovery.forget_dead`): it shares the rule that says
who is dead.
"""

from __future__ import annotations

from typing import Any

import redis

from producers.keys import CONSUMER_GROUP


def trim_acked(client: redis.Redis, stream: str) -> int:
    """Delete entries of ``stream`` every consumer is done with; returns how many went.

    Safe without a transaction: entries below the computed bound were
    delivered and acked, and the pending set only ever gains entries above
    the group's last-delivered id (or ones already pending).
    """
    groups: Any = client.xinfo_groups(stream)
    group = next((g for g in groups if g["name"] == CONSUMER_GROUP.encode()), None)
    if group is None:
        return 0
    pending: Any = client.xpending(stream, CONSUMER_GROUP)
    bound = pending["min"] if pending["pending"] else _next_id(group["last-delivered-id"])
    trimmed: int = client.xtrim(stream, minid=bound, approximate=False)
    return trimmed


def _next_id(entry_id: bytes) -> str:
    ms, seq = entry_id.decode().split("-")
    return f"{ms}-{int(seq) + 1}"
