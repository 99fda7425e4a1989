"""Taking over the jobs of dead daemons, never those of live ones.

A pending entry looks idle while its daemon generates for minutes, so idle
time alone proves nothing. The claim script checks, atomically with the
XCLAIM, that the owner's heartbeat key is gone: a live daemon refreshes it
every ``heartbeat_interval_s``, a dead one's expires after ``heartbeat_ttl_s`` (on a
Redis Cluster the check comes just before: batchd.daemon.fleet.liveness).
Claimed entries are then picked up like new ones: their events streams say
where each job stopped. A restarted daemon with a configured (stable)
consumer name first reads its own pending entries back (XREADGROUP from 0).
Dead consumers left with nothing pending are removed from the group (names
are host:pid by default, so every restart leaves one behind). Each partition of a
queue is a stream with a group of its own: every call here is about one of them.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from batchd.daemon.fleet.liveness import DEAD_RULE, Liveness
from batchd.daemon.worker.jobs import Delivery
from batchd.daemon.worker.member import Member
from batchd.producers.keys import CONSUMER_GROUP

log = logging.getLogger(__name__)

# Add a lost entry again and make it the one that holds its job id (the status hash
# names the entry that took the job; pickup refuses any other as a duplicate). KEYS[2],
# the status hash, only where it is in the entry's partition (an entry filed under
# another is only dead-lettered: batchd.daemon.worker.jobs.Job.misfiled).
_REQUEUE = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV))
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'entry', id)
end
return id
"""

# How many pending entries one claim pass looks at (live daemons' entries included).
SCAN = 1000

# KEYS[1] queue stream; ARGV[6] most to claim, ARGV[7] how many pending entries to scan.
# Returns {claimed, deleted}: {entry id, delivery count, previous owner, {field, value, ...}}
# per claimed entry, and the ids of pending entries whose stream entry was gone (acked).
_CLAIM = (
    DEAD_RULE
    + """
local out = {}
local deleted = {}
local want = tonumber(ARGV[6])
local pending = redis.call('XPENDING', KEYS[1], ARGV[2], 'IDLE', ARGV[4], '-', '+', ARGV[7])
for _, entry in ipairs(pending) do
  if #out >= want then break end
  local owner = entry[2]
  if owner ~= ARGV[3] and dead(owner) then
    local claimed = redis.call('XCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[4], entry[1])
    if type(claimed[1]) == 'table' then
      table.insert(out, {entry[1], entry[4] + 1, owner, claimed[1][2]})
    else
      -- The stream entry was deleted while pending: Redis 6.2 returns nil for it and
      -- keeps it pending (7.x drops it from the PEL and returns nothing). Ack it so
      -- it does not hold back trimming, and report it.
      redis.call('XACK', KEYS[1], ARGV[2], entry[1])
      table.insert(deleted, entry[1])
    end
  end
end
return {out, deleted}
"""
)

# KEYS[1] queue stream. Returns how many consumers were removed.
_FORGET = (
    DEAD_RULE
    + """
local gone = 0
for _, info in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[2])) do
  local c = {}
  for i = 1, #info, 2 do c[info[i]] = info[i + 1] end
  if c['name'] ~= ARGV[3] and c['pending'] == 0 and c['idle'] > tonumber(ARGV[4])
     and dead(c['name']) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[2], c['name'])
    gone = gone + 1
  end
end
return gone
"""
)


class Recovery:
    """Own pending entries at start, claims from consumers whose heartbeat expired,
    and forgetting those consumers once they hold nothing."""

    def __init__(
        self, member: Member, *, heartbeat_ttl_s: float, stall_timeout_s: float = 300.0
    ) -> None:
        self.member = member
        self.liveness = Liveness(member, stall_timeout_s=stall_timeout_s)
        # Besides the heartbeat check: nothing idle for less than a heartbeat TTL is touched.
        self.min_idle_ms = int(heartbeat_ttl_s * 1000)
        self._claim = member.redis.register_script(_CLAIM)
        self._forget = member.redis.register_script(_FORGET)
        self._requeue = member.redis.register_script(_REQUEUE)

    def own_pending(self, queue: str, partition: int = 0) -> list[Delivery]:
        """Entries this consumer name already holds (a restart under a stable name)."""
        stream = self.member.keys.queue(queue, partition)
        out: list[Delivery] = []
        last = "0"
        while True:
            reply: Any = self.member.redis.xreadgroup(
                CONSUMER_GROUP, self.member.consumer, {stream: last}, count=100
            )
            entries = reply[0][1] if reply else []
            if not entries:
                break
            ids = [entry_id for entry_id, _ in entries]
            pending: Any = self.member.redis.xpending_range(
                stream, CONSUMER_GROUP, ids[0], ids[-1], len(ids), consumername=self.member.consumer
            )
            counts = {p["message_id"]: p["times_delivered"] for p in pending}
            for entry_id, fields in entries:
                if fields is None:  # deleted from the stream while pending
                    self.member.redis.xack(stream, CONSUMER_GROUP, entry_id)
                    continue
                deliveries = counts.get(entry_id, 1)
                out.append(Delivery(queue, entry_id.decode(), fields, deliveries, partition))
            last = ids[-1].decode()
        if out:
            log.info("recovered %d own pending job(s) on queue %s", len(out), queue)
        return out

    def take_back(self, delivery: Delivery, job_id: str) -> bool:
        """After Redis lost writes of a job held here: True if its entry is still pending
        for this daemon (pick the job up again). Pending elsewhere, or in the stream and
        not pending (to be delivered again, or already acked), the queue has it: False.
        Gone from the stream (Redis lost the entry itself, or its submit), the job exists
        only in this process: its entry is added again from memory (False), so that a
        daemon dying later cannot leave a job nobody will ever resume."""
        stream = self.member.stream(delivery)
        entry = delivery.entry_id
        try:
            pending: Any = self.member.redis.xpending_range(stream, CONSUMER_GROUP, entry, entry, 1)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            pending = []  # the group is gone with the rest (intake creates it again)
        if self.member.redis.xrange(stream, entry, entry):
            return bool(pending) and pending[0]["consumer"].decode() == self.member.consumer
        if pending:  # deleted while pending: nothing left to deliver, it holds back trimming
            self.member.redis.xack(stream, CONSUMER_GROUP, entry)
        fields = [part for pair in delivery.fields.items() for part in pair]
        keys = [stream]
        if self.member.keys.partition(job_id) == delivery.partition:
            keys.append(self.member.keys.job(job_id))
        added: Any = self._requeue(keys=keys, args=fields)
        log.warning(
            "queue entry %s was lost by Redis; its job enqueued again as %s",
            entry,
            added.decode(),
        )
        return False

    def strays(self, queue: str, partition: int = 0, *, held: set[str]) -> list[Delivery]:
        """Entries pending for this consumer that it does not hold: a lost XREADGROUP
        reply, or a pickup cut short. Taken back (XCLAIM to itself) to be picked up."""
        stream = self.member.keys.queue(queue, partition)
        pending: Any = self.member.redis.xpending_range(
            stream, CONSUMER_GROUP, "-", "+", SCAN, consumername=self.member.consumer
        )
        out = []
        for row in pending:
            entry_id = row["message_id"]
            if entry_id.decode() in held:
                continue
            claimed: Any = self.member.redis.xclaim(
                stream, CONSUMER_GROUP, self.member.consumer, 0, [entry_id]
            )
            if not claimed or claimed[0] is None or claimed[0][1] is None:
                self.member.redis.xack(stream, CONSUMER_GROUP, entry_id)
                log.error("own pending entry %s was deleted from the stream; acked", entry_id)
                continue
            log.warning("entry %s on queue %s was pending here unseen; picked up", entry_id, queue)
            deliveries = int(row["times_delivered"]) + 1
            out.append(Delivery(queue, entry_id.decode(), claimed[0][1], deliveries, partition))
        return out

    def claim(self, queue: str, partition: int = 0, *, limit: int) -> list[Delivery]:
        """Up to ``limit`` entries of dead consumers on partition ``partition`` of
        ``queue``, now owned by this one."""
        if limit <= 0:
            return []
        stream = self.member.keys.queue(queue, partition)
        rows, deleted = self._claim(keys=[stream], args=self._args(limit, SCAN))
        for entry_id in deleted:
            log.error(
                "pending entry %s on queue %s was deleted from the stream; acked, job lost",
                entry_id.decode(),
                queue,
            )
        out = []
        for entry_id, deliveries, owner, flat in rows:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            out.append(Delivery(queue, entry_id.decode(), fields, int(deliveries), partition))
            log.warning(
                "claimed job entry %s on queue %s from dead consumer %s",
                entry_id.decode(),
                queue,
                owner.decode(),
            )
        return out

    def forget_dead(self, queue: str, partition: int = 0) -> int:
        """Remove dead consumers with nothing pending from the group of partition
        ``partition`` of ``queue``; returns how many."""
        stream = self.member.keys.queue(queue, partition)
        gone: int = self._forget(keys=[stream], args=self._args())
        return gone

    def _args(self, *extra: int) -> list[str | int]:
        return [*self.liveness.args(self.min_idle_ms), *extra]
