"""The fenced append: a job's events and status written by its owner only, in order.

One script per job and step does, atomically: check that this daemon still
owns the job (its ``epoch`` is not below the one stored on the status hash;
a higher epoch means a later pickup took the job over), check that the
events stream ends where this daemon believes (a shorter stream means Redis
lost writes; a longer one, that a resent step or another daemon stored more),
then append the events in order, stopping at the first refused one, and only
then write the status fields. The stream's end is read from its length, which
is its last seq while only owners write it (ids ``0-1``, ``0-2``, ...), and the
first append is refused if anything stands past it; the last entry itself
(XREVRANGE, many times XLEN's cost in Redis's time, for every job at every
publish) is read only when the length disagrees, the first append is refused,
or there is no event to append, so an edited stream (entries deleted, or added
with other ids) is judged by its last entry as before. So a refused write (OOM,
READONLY, NOPERM) never leaves a gap, a partitioned daemon never interleaves its
tokens with the new owner's, and a status never runs ahead of the events it
describes.

The epoch is taken at pickup (the stored epoch plus one) and claimed by the
first append, so each pickup of a job fences off every earlier one.

The first append of a pickup also checks that the job's queue entry is still in the
stream. Redis with AOF ``everysec`` can lose a job's submit (its status hash and
entry) after this daemon read it; an append would then write the job's keys again,
``running``, with nothing behind them that names the request: were this daemon to
die, no one could run the job again, and the sweep could only end it with an error
while a follower may have read it end. So nothing is written (``gone``) and the
daemon adds the entry again from what it holds (batchd.daemon.fleet.recovery): the
job is picked up from the new entry and runs as it would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis
from redis.client import Pipeline

from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.redis_io import load_scripts, queue_script
from batchd.producers.connection import is_cluster
from batchd.producers.keys import EVENT_FIELD, Keys, event_id
from batchd.producers.schema import Event

# The epoch of a rejected entry's job: written only if the job's keys do not exist yet.
CREATE_ONLY = 0

# KEYS[1] events stream, KEYS[2] status hash, KEYS[3] tokens channel, KEYS[4] queue stream
# (the job's partition of its queue: one slot with the job's keys on a Redis Cluster).
# ARGV[1] owner, ARGV[2] epoch, ARGV[3] events the owner believes stored,
# ARGV[4] result TTL in seconds, ARGV[5] n, ARGV[6] the job's queue entry ('': not
# checked), then n (entry id, event JSON) pairs, then status field/value pairs.
# A create-only append sets the keys' TTL itself: if its reply is lost, the retry
# finds the keys and is answered 'lost', so no later EXPIRE would ever reach them.
# The claim (epoch, owner) fences off earlier holders even when the stream is not where
# this append believed ('tip'), but never creates the status hash then: a late append to
# a job whose keys expired, or whose keys a failover took while its queue entry stayed,
# would leave a hash that only the sweep, late, gives a TTL.
_APPEND = f"""
local created = false
if ARGV[2] == '{CREATE_ONLY}' then
  if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
    return {{'lost'}}
  end
  ARGV[2] = '1'
  created = true
end
local held = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0')
local mine = tonumber(ARGV[2])
if held > mine or (held == mine and redis.call('HGET', KEYS[2], 'owner') ~= ARGV[1]) then
  return {{'lost'}}
end
if held < mine and not created and ARGV[6] ~= ''
   and #redis.call('XRANGE', KEYS[4], ARGV[6], ARGV[6]) == 0 then
  return {{'gone'}}
end
local function tip()
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #last == 0 then return 0 end
  return tonumber(string.match(last[1][1], '%-(%d+)$'))
end
local function claim()
  if held < mine then
    redis.call('HSET', KEYS[2], 'epoch', ARGV[2], 'owner', ARGV[1])
    if created then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
  end
end
local believed = tonumber(ARGV[3])
local n = tonumber(ARGV[5])
if n == 0 or redis.call('XLEN', KEYS[1]) ~= believed then
  local stored = tip()
  if stored ~= believed then
    if redis.call('EXISTS', KEYS[2]) == 1 then claim() end
    return {{'tip', stored}}
  end
end
claim()
for i = 0, n - 1 do
  local r = redis.pcall('XADD', KEYS[1], ARGV[7 + 2 * i], '{EVENT_FIELD}', ARGV[8 + 2 * i])
  if type(r) == 'table' and r.err then
    if i == 0 then
      local stored = tip()
      if stored ~= believed then return {{'tip', stored}} end
    end
    return {{'refused', i, r.err}}
  end
  redis.pcall('@PUBLISH@', KEYS[3], ARGV[8 + 2 * i])
  if created and i == 0 then redis.pcall('EXPIRE', KEYS[1], ARGV[4]) end
end
if #ARGV > 6 + 2 * n then
  local r = redis.pcall('HSET', KEYS[2], unpack(ARGV, 7 + 2 * n))
  if type(r) == 'table' and r.err then return {{'refused', n, r.err}} end
end
return {{'ok', n}}
"""
# On a Redis Cluster the tokens channel is a sharded one (SPUBLISH, read by SSUBSCRIBE):
# a script may publish there, in its own slot; PUBLISH would reach every node.
APPEND = _APPEND.replace("@PUBLISH@", "PUBLISH")
APPEND_SHARDED = _APPEND.replace("@PUBLISH@", "SPUBLISH")


class Outcome(Enum):
    stored = "ok"  # every event and the status are stored
    refused = "refused"  # the first ``count`` events are stored; Redis refused the next write
    lost = "lost"  # a later pickup owns the job: nothing was written
    tip = "tip"  # the stream holds ``count`` events, not what the owner believed
    gone = "gone"  # the job's queue entry is gone (Redis lost its submit): nothing was written


@dataclass(frozen=True)
class Reply:
    outcome: Outcome
    count: int = 0
    error: str = ""
    # Redis does not have the script (restarted, or SCRIPT FLUSH): load it again.
    noscript: bool = False

    @classmethod
    def parse(cls, raw: Any) -> Reply:
        """The script's reply; a whole-script error reply (NOPERM, WRONGTYPE on the
        stream, NOSCRIPT) means nothing was written."""
        if isinstance(raw, redis.ResponseError):
            noscript = isinstance(raw, redis.exceptions.NoScriptError)
            return cls(Outcome.refused, 0, str(raw), noscript=noscript)
        outcome = Outcome(raw[0].decode())
        count = int(raw[1]) if len(raw) > 1 else 0
        error = raw[2].decode(errors="replace") if len(raw) > 2 else ""
        return cls(outcome, count, error)


class Fence:
    """Queues one fenced append per job into a pipeline."""

    def __init__(self, client: redis.Redis, keys: Keys, *, owner: str, result_ttl_s: int) -> None:
        self.keys = keys
        self.owner = owner
        self.result_ttl_s = result_ttl_s
        self.script = client.register_script(APPEND_SHARDED if is_cluster(client) else APPEND)

    def load(self, client: redis.Redis) -> None:
        """Load the script (once, and again after a NOSCRIPT: Redis restarted or flushed,
        or a replica was promoted)."""
        load_scripts(client, self.script)

    def queue(
        self,
        pipe: Pipeline,
        job: Job,
        events: list[Event] | None = None,
        status: dict[str, str] | None = None,
    ) -> None:
        """Queue the append of ``events`` and ``status`` (default: the job's outbox)."""
        if events is None or status is None:
            events, status = job.outbox()
        args: list[Any] = [
            self.owner,
            job.epoch,
            job.stored_events,
            self.result_ttl_s,
            len(events),
            job.delivery.entry_id if job.from_queue else "",
        ]
        for event in events:
            args += [event_id(event.seq), event.encode()]
        for name, value in status.items():
            args += [name, value]
        keys = [
            self.keys.events(job.job_id),
            self.keys.job(job.job_id),
            self.keys.tokens(job.job_id),
            self.keys.queue(job.delivery.queue, job.delivery.partition),
        ]
        queue_script(pipe, self.script, keys, args)
