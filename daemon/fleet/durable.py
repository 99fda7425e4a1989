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

Redis >= 7.2 could confirm durability directly (``WAITAOF 1 0``); this check
works on every supported server (6.2 on) and costs one pipelined HGET per job.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import redis

from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.member import Member
from batchd.producers.schema import JobState

log = logging.getLogger(__name__)

# Two everysec fsync windows and a margin: an end older than this survived any crash
# that Redis came back from before the check.
DURABLE_AFTER_S = 3.0

_TERMINAL = {state.value.encode() for state in JobState if state.terminal}


@dataclass(frozen=True)
class _Ended:
    job_id: str
    delivery: Delivery
    at: float  # monotonic time its end was confirmed


class DurabilityWatch:
    """Ended jobs' deliveries, oldest first, until their end is known to be durable."""

    def __init__(self, member: Member, *, after_s: float = DURABLE_AFTER_S) -> None:
        self.member = member
        self.after_s = after_s
        self._ended: deque[_Ended] = deque()

    def __len__(self) -> int:
        return len(self._ended)

    def ended(self, job: Job) -> None:
        """``job``'s final event, status and ack are confirmed: watch it."""
        if job.foreign or job.request is None:
            return  # a bad entry's dead letter: no job of its own to end again
        self._ended.append(_Ended(job.job_id, job.delivery, time.monotonic()))

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
        states = pipe.execute(raise_on_error=False)
        lost: list[Delivery] = []
        for ended, state in zip(due, states, strict=True):
            if isinstance(state, redis.ResponseError):
                break  # checked again next time, with the jobs after it
            self._ended.popleft()
            if state is None or state in _TERMINAL:
                # Gone: expired (a short result TTL), or Redis lost the submit itself, which
                # its producer hears of (JobNotFound) and submits again.
                continue
            log.warning(
                "job %s: Redis lost its end after acknowledging it (state now %s); picked up again",
                ended.job_id,
                state.decode(errors="replace"),
            )
            lost.append(ended.delivery)
        return lost
