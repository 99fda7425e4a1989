"""Taking over the jobs of dead daemons, never those of live ones.

A pending entry looks idle while its daemon generates for minutes, so idle
time alone proves nothing. The claim script checks, atomically with the
XCLAIM, that the owner's heartbeat key is gone: a live daemon refreshes it
every ``heartbeat_interval_s``, a dead one's expires after ``heartbeat_ttl_s``.
Claimed entries are then picked up like new ones: their events streams say
where each job stopped. A restarted daemon with a configured (stable)
consumer name first reads its own pending entries back (XREADGROUP from 0).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from daemon.jobs import Delivery
from producers.keys import CONSUMER_GROUP, Keys

log = logging.getLogger(__name__)

# How many pending entries one claim pass looks at (live daemons' entries included).
SCAN = 1000

# KEYS[1] queue stream; ARGV: group, consumer, min idle ms, heartbeat key prefix, most to claim.
# Returns {entry id, delivery count, previous owner, {field, value, ...}} per claimed entry.
_CLAIM = """
local out = {}
local want = tonumber(ARGV[5])
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', ARGV[6])
for _, entry in ipairs(pending) do
  if #out >= want then break end
  local owner = entry[2]
  if owner ~= ARGV[2] and redis.call('EXISTS', ARGV[4] .. owner) == 0 then
    local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], entry[1])
    if #claimed > 0 then
      table.insert(out, {entry[1], entry[4] + 1, owner, claimed[1][2]})
    end
  end
end
return out
"""


class Recovery:
    """Own pending entries at start, and claims from consumers whose heartbeat expired."""

    def __init__(
        self, client: redis.Redis, keys: Keys, *, consumer: str, heartbeat_ttl_s: float
    ) -> None:
        self.redis = client
        self.keys = keys
        self.consumer = consumer
        self.min_idle_ms = int(heartbeat_ttl_s * 1000)
        self._claim = client.register_script(_CLAIM)

    def own_pending(self, queue: str) -> list[Delivery]:
        """Entries this consumer name already holds (a restart under a stable name)."""
        stream = self.keys.queue(queue)
        out: list[Delivery] = []
        last = "0"
        while True:
            reply: Any = self.redis.xreadgroup(
                CONSUMER_GROUP, self.consumer, {stream: last}, count=100
            )
            entries = reply[0][1] if reply else []
            if not entries:
                break
            ids = [entry_id for entry_id, _ in entries]
            pending: Any = self.redis.xpending_range(
                stream, CONSUMER_GROUP, ids[0], ids[-1], len(ids), consumername=self.consumer
            )
            counts = {p["message_id"]: p["times_delivered"] for p in pending}
            for entry_id, fields in entries:
                if fields is None:  # deleted from the stream while pending
                    self.redis.xack(stream, CONSUMER_GROUP, entry_id)
                    continue
                out.append(
                    Delivery(queue, entry_id.decode(), fields, deliveries=counts.get(entry_id, 1))
                )
            last = ids[-1].decode()
        if out:
            log.info("recovered %d own pending job(s) on queue %s", len(out), queue)
        return out

    def claim(self, queue: str, *, limit: int) -> list[Delivery]:
        """Up to ``limit`` entries of dead consumers on ``queue``, now owned by this one."""
        if limit <= 0:
            return []
        rows = self._claim(
            keys=[self.keys.queue(queue)],
            args=[
                CONSUMER_GROUP,
                self.consumer,
                self.min_idle_ms,
                self.keys.daemon(""),
                limit,
                SCAN,
            ],
        )
        out = []
        for entry_id, deliveries, owner, flat in rows:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            out.append(Delivery(queue, entry_id.decode(), fields, deliveries=int(deliveries)))
            log.warning(
                "claimed job entry %s on queue %s from dead consumer %s",
                entry_id.decode(),
                queue,
                owner.decode(),
            )
        return out
