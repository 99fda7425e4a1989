"""Every operator action, logged twice: a log line, and an entry on the audit stream.

The log line (logger ``batchd.dashboard.audit``, fields ``event=dashboard_action``,
``operator``, ``action``, ``target``, ``outcome``) survives a Redis outage; the stream
(``<prefix>:dashboard:audit``, about 10,000 entries kept) is what the dashboard shows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from batchd.producers.dashboard.records.names import AUDIT_MAXLEN, audit_stream
from batchd.producers.keys import Keys

log = logging.getLogger("batchd.dashboard.audit")

FIELDS = ("operator", "action", "target", "outcome", "note")


@dataclass(frozen=True)
class AuditEntry:
    at: float
    operator: str
    action: str
    target: str
    outcome: str
    note: str


class Audit:
    """Writes and reads the audit trail of one dashboard."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.redis = client
        self.stream = audit_stream(keys)

    async def record(
        self, *, operator: str, action: str, target: str, outcome: str, note: str = ""
    ) -> None:
        """Log the action, then append it to the stream (a refused append is logged)."""
        values: dict[Any, Any] = dict(
            operator=operator, action=action, target=target, outcome=outcome, note=note
        )
        log.info(
            "operator %s: %s %s: %s%s",
            operator,
            action,
            target,
            outcome,
            f" ({note})" if note else "",
            extra={"event": "dashboard_action", **values},
        )
        try:
            await self.redis.xadd(
                self.stream,
                {**values, "at": f"{time.time():.3f}"},
                maxlen=AUDIT_MAXLEN,
                approximate=True,
            )
        except (redis.RedisError, OSError) as exc:
            log.error("audit entry not stored (%s): the log line above is the record", exc)

    async def recent(self, count: int = 10) -> list[AuditEntry]:
        entries: Any = await self.redis.xrevrange(self.stream, count=count)
        return [parse_entry(fields) for _, fields in entries]


def parse_entry(fields: dict[bytes, bytes]) -> AuditEntry:
    text = {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
    try:
        at = float(text.get("at", "0"))
    except ValueError:
        at = 0.0
    return AuditEntry(at, *(text.get(name, "") for name in FIELDS))
