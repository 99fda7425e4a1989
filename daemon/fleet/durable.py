"""Finished jobs kept until Redis has surely stored their end: acknowledged is not durable.

With AOF ``appendfsync everysec`` Redis acknowledges a write and may lose it in a
crash up to about a second later (two when the disk lags). A job whose final
event, status and XACK Redis confirmed is therefore remembered here (its delivery
only) for :data:`DURABLE_AFTER_S`; then its status is read once. A terminal state
means the end was stored before the crash window closed (the AOF keeps writes in
order, so the final event before it is stored too) and the job is forgotten.
A hash that is gone expired (or Redis lost the submit itself, which the producer
hears of as JobNotFound). Still ``running`` (the crash took the final event and
status but not the tokens before them) means Redis lost the end:
the delivery is picked up again, which resumes from what the events stream holds
(every job samples as if seeded, so the re-run continues the same text) or
repairs the status from a surviving final event, and ends the job with its TTL.

A daemon killed before its check leaves the job to the group: the pending entry is
claimed when the crash lost the XACK too, and when the XACK reached the Redis that
came back, trimming keeps the acked entry of a job not ended and the sweep enqueues it
again (batchd.daemon.fleet.housekeeping, batchd.daemon.fleet.sweep).

A *cancelled* end is written only once the cancel request and the tokens before it
are durable (Job.final_held), so a daemon that runs the job again after Redis lost
the end finds both and ends it where its follower read it end, cancelled: that holds
when the daemon that ended it is gone too. While that daemon lives, the end is also
kept whole here (its events and status, read back once when the job ends: cancels
are few) and a lost one is written back from memory, by a script that first checks
that no later pickup took the job and that the stream holds no more than this daemon
wrote, then picked up, which only repairs the status and acks.

Redis >= 7.2 could confirm durability directly (``WAITAOF 1 0``); this check
works on every supported server (6.2 on) and costs one pipelined HGET per job.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from batchd.daemon.worker.jobs import DURABLE_AFTER_S, Delivery, Job
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.redis_io import REDIS_DOWN, pipeline_replies
from batchd.producers.keys import EVENT_FIELD
from batchd.producers.schema import FinishReason, JobState

log = logging.getLogger(__name__)

_TERMINAL = {state.value.encode() for state in JobState if state.terminal}


# KEYS[1] events stream, KEYS[2] status hash. ARGV[1] the epoch of the pickup that ended
# the job, ARGV[2] result TTL s, ARGV[3] n events, then n (entry id, event JSON) pairs,
# then the status hash as it was at the end (field/value pairs). Writes back the events
# the stream lacks and the status; 1, or 0 (nothing written) when a later pickup took
# the job, it ended since, or the stream holds more than the events kept.
_RESTORE = f"""
if tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0') > tonumber(ARGV[1]) then return 0 end
local state = redis.call('HGET', KEYS[2], 'state')
if state and state ~= 'queued' and state ~= 'running' then return 0 end
local n = tonumber(ARGV[3])
local have = redis.call('XLEN', KEYS[1])
if have > n then return 0 end
for i = have + 1, n do
  redis.call('XADD', KEYS[1], ARGV[2 + 2 * i], '{EVENT_FIELD}', ARGV[3 + 2 * i])
end
redis.call('HSET', KEYS[2], unpack(ARGV, 4 + 2 * n))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class _Ended:
    job_id: str
    delivery: Delivery
    at: float  # monotonic time its end was confirmed
    epoch: int = 0
    # A cancelled end as stored: its events (entry id, event JSON) and status hash.
    events: tuple[tuple[bytes, bytes], ...] = ()
    status: tuple[tuple[bytes, bytes], ...] = ()


class DurabilityWatch:
    """Ended jobs' deliveries, oldest first, until their end is known to be durable."""

    def __init__(
        self, member: Member, *, result_ttl_s: int, after_s: float = DURABLE_AFTER_S
    ) -> None:
        self.member = member
        self.result_ttl_s = result_ttl_s
        self.after_s = after_s
        self._ended: deque[_Ended] = deque()
        self._restore = member.redis.register_script(_RESTORE)

    def __len__(self) -> int:
        return len(self._ended)

    def ended(self, job: Job) -> None:
        """``job``'s final event, status and ack are confirmed: watch it."""
        if job.foreign or job.request is None:
            return  # a bad entry's dead letter: no job of its own to end again
        ended = _Ended(job.job_id, job.delivery, time.monotonic())
        if job.finish_reason is FinishReason.cancelled:
            ended = self._kept(ended, job.epoch)
        self._ended.append(ended)

    def _kept(self, ended: _Ended, epoch: int) -> _Ended:
        """``ended`` with its events and status as Redis holds them now (its end was just
        confirmed), or as it is when Redis does not answer (it is then run again if lost)."""
        keys = self.member.keys
        pipe = self.member.redis.pipeline(transaction=False)
        pipe.xrange(keys.events(ended.job_id))
        pipe.hgetall(keys.job(ended.job_id))
        try:
            entries, status = pipe.execute()
        except (*REDIS_DOWN, redis.ResponseError) as exc:
            log.warning("job %s: cancelled end not kept (%s)", ended.job_id, exc)
            return ended
        if not entries or not status:
            return ended
        events = tuple((entry_id, fields[EVENT_FIELD.encode()]) for entry_id, fields in entries)
        return _Ended(ended.job_id, ended.delivery, ended.at, epoch, events, tuple(status.items()))

    def entries(self) -> set[str]:
        """Entry ids still watched (this daemon accounts for them)."""
        return {ended.delivery.entry_id for ended in self._ended}

    def lost(self, *, now: float | None = None) -> list[Delivery]:
        """Check the jobs whose end is old enough; the deliveries of those Redis lost the
        end of (to be picked up again). Raises Redis errors, keeping every job watched."""
        now = time.monotonic() if now is None else now
        due: list[_Ended] = []
        while len(due) < len(self._ended) and now - self._ended[len(due)].at >= self.after_s:
            due.append(self._ended[len(due)])
        if not due:
            return []
        pipe = self.member.redis.pipeline(transaction=False)
        for ended in due:
            pipe.hget(self.member.keys.job(ended.job_id), "state")
        states = pipeline_replies(pipe)
        lost: list[Delivery] = []
        for ended, state in zip(due, states, strict=True):
            if isinstance(state, redis.ResponseError):
                break  # checked again next time, with the jobs after it
            self._ended.popleft()
            if state in _TERMINAL or (state is None and not ended.events):
                # Gone: expired (a short result TTL), or Redis lost the submit itself, which
                # its producer hears of (JobNotFound) and submits again; or a raw producer's
                # job whose pickup was lost too: its entry, if kept, is run again, and a
                # run again ends as this one did. A cancelled end is the exception.
                continue
            restored = bool(ended.events) and self._write_back(ended)
            log.warning(
                "job %s: Redis lost its end after acknowledging it (state now %s); %s",
                ended.job_id,
                "gone" if state is None else state.decode(errors="replace"),
                "written back from memory" if restored else "picked up again",
            )
            lost.append(ended.delivery)
        return lost

    def _write_back(self, ended: _Ended) -> bool:
        """Write a lost cancelled end back (the _RESTORE script's checks); True if done."""
        keys = self.member.keys
        args: list[Any] = [ended.epoch, self.result_ttl_s, len(ended.events)]
        args += [part for pair in ended.events for part in pair]
        args += [part for pair in ended.status for part in pair]
        try:
            done = self._restore(
                keys=[keys.events(ended.job_id), keys.job(ended.job_id)], args=args
            )
        except redis.ResponseError as exc:
            log.warning("job %s: cancelled end not written back (%s)", ended.job_id, exc)
            return False
        return bool(done)
