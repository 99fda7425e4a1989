"""Keeping a queue stream and its group small: trim acked entries, forget dead consumers.

Trimming uses MINID at the oldest entry the group still needs (the oldest
pending one, else the first not yet delivered), never MAXLEN, which could
drop an unacked job. Consumer names are host:pid by default, so each
restart leaves one behind; those with nothing pending and no heartbeat go.
"""

from __future__ import annotations

from typing import Any

import redis

from producers.keys import CONSUMER_GROUP, Keys

# KEYS[1] queue stream; ARGV: group, consumer, heartbeat key prefix, min idle ms.
_FORGET = """
local gone = 0
for _, info in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local c = {}
  for i = 1, #info, 2 do c[info[i]] = info[i + 1] end
  if c['name'] ~= ARGV[2] and c['pending'] == 0 and c['idle'] > tonumber(ARGV[4])
     and redis.call('EXISTS', ARGV[3] .. c['name']) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], c['name'])
    gone = gone + 1
  end
end
return gone
"""


class Housekeeping:
    def __init__(
        self, client: redis.Redis, keys: Keys, *, consumer: str, heartbeat_ttl_s: float
    ) -> None:
        self.redis = client
        self.keys = keys
        self.consumer = consumer
        self.min_idle_ms = int(heartbeat_ttl_s * 1000)
        self._forget = client.register_script(_FORGET)

    def run(self, queue: str) -> None:
        self.trim_acked(queue)
        self.forget_dead_consumers(queue)

    def trim_acked(self, queue: str) -> int:
        """Delete entries every consumer is done with; returns how many went.

        Safe without a transaction: entries below the computed bound were
        delivered and acked, and the pending set only ever gains entries
        above the group's last-delivered id (or ones already pending).
        """
        stream = self.keys.queue(queue)
        groups: Any = self.redis.xinfo_groups(stream)
        group = next((g for g in groups if g["name"] == CONSUMER_GROUP.encode()), None)
        if group is None:
            return 0
        pending: Any = self.redis.xpending(stream, CONSUMER_GROUP)
        bound = pending["min"] if pending["pending"] else _next_id(group["last-delivered-id"])
        trimmed: int = self.redis.xtrim(stream, minid=bound, approximate=False)
        return trimmed

    def forget_dead_consumers(self, queue: str) -> int:
        gone: int = self._forget(
            keys=[self.keys.queue(queue)],
            args=[CONSUMER_GROUP, self.consumer, self.keys.daemon(""), self.min_idle_ms],
        )
        return gone


def _next_id(entry_id: bytes) -> str:
    ms, seq = entry_id.decode().split("-")
    return f"{ms}-{int(seq) + 1}"
