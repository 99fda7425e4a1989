"""Who is dead: the one rule by which jobs are claimed, consumers forgotten and jobs swept.

A daemon is dead when its heartbeat key is gone (expired, or deleted at a graceful
stop), or when the heartbeat says it has work and completed no step for the stall
timeout (a wedged engine). On one Redis the scripts apply the rule themselves,
reading the heartbeat atomically with the claim. A Redis Cluster refuses a script any
key outside its slot, and every heartbeat key lies in a slot of its own: there the
caller reads the heartbeats (every primary's, SCAN) just before the scripts run and
passes the names of the live daemons. A daemon whose heartbeat expires in between is
taken for alive until the next pass; one that comes back after its jobs were claimed
is fenced off by their epochs (batchd.daemon.worker.fence), as on one Redis.
"""

from __future__ import annotations

from typing import Any

import orjson

from batchd.daemon.worker.member import Member
from batchd.producers.keys import CONSUMER_GROUP

# Every script using the rule gets ARGV: heartbeat key prefix, group, this consumer, min
# idle ms, stall timeout s, then its own. On a Cluster ARGV[1] is '' and ARGV[5] the JSON
# list of live daemons' names.
DEAD_RULE = """
local live = nil
if ARGV[1] == '' then
  live = {}
  for _, name in ipairs(cjson.decode(ARGV[5])) do live[name] = true end
end
local function dead(name)
  if live then return not live[name] end
  local beat = redis.call('GET', ARGV[1] .. name)
  if not beat then return true end
  local ok, body = pcall(cjson.decode, beat)
  if not ok or type(body) ~= 'table' or not body['busy'] then return false end
  local last = tonumber(body['last_step_at'])
  if not last then return false end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000 - last > tonumber(ARGV[5])
end
"""


class Liveness:
    """The rule's arguments for the scripts of one claim pass."""

    def __init__(self, member: Member, *, stall_timeout_s: float) -> None:
        self.member = member
        self.stall_timeout_s = stall_timeout_s
        self._live: list[str] = []

    def refresh(self) -> None:
        """Read who is alive now (a Redis Cluster only: elsewhere the scripts read it)."""
        if self.member.cluster:
            self._live = self._read_live()

    def args(self, min_idle_ms: int) -> list[str | int]:
        """The rule's five script arguments (see :data:`DEAD_RULE`)."""
        group, me = CONSUMER_GROUP, self.member.consumer
        if not self.member.cluster:
            prefix = self.member.keys.daemon("")
            return [prefix, group, me, min_idle_ms, repr(self.stall_timeout_s)]
        return ["", group, me, min_idle_ms, orjson.dumps(self._live).decode()]

    def _read_live(self) -> list[str]:
        client: Any = self.member.redis
        prefix = self.member.keys.daemon("")
        names = [key for key in client.scan_iter(match=self.member.keys.daemon_pattern)]
        if not names:
            return []
        beats = client.mget_nonatomic(names)
        seconds, micros = client.time()
        now = seconds + micros / 1_000_000
        live = []
        for key, beat in zip(names, beats, strict=True):
            if beat is not None and not _stalled(beat, now, self.stall_timeout_s):
                live.append(key.decode(errors="replace")[len(prefix) :])
        return live


def _stalled(beat: bytes, now: float, stall_timeout_s: float) -> bool:
    """The Lua rule's stall clause: busy, and no step for ``stall_timeout_s``."""
    try:
        body = orjson.loads(beat)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(body, dict) or not body.get("busy"):
        return False
    last = body.get("last_step_at")
    return isinstance(last, int | float) and now - last > stall_timeout_s
