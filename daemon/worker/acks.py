"""Queue entries this daemon is done with: acked until Redis confirms, or handed back.

An XACK that Redis refuses (READONLY, NOPERM) or whose reply is lost must not
leave the entry pending forever (it would also hold back trimming): every
entry to ack stays here until a reply confirms it, and is tried again at every
claim interval. Handing back (a graceful stop) marks unfinished entries
claimable at once.
"""

from __future__ import annotations

import logging

import redis

from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.redis_io import REDIS_DOWN, pipeline_replies
from batchd.producers.keys import CONSUMER_GROUP

log = logging.getLogger(__name__)


class Acks:
    """Entries to XACK (retried until done), and the hand-back of unfinished ones."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.unacked: list[Delivery] = []

    def ack(self, deliveries: list[Delivery]) -> None:
        """Ack ``deliveries`` now (and any left from before); raises REDIS_DOWN errors,
        keeping every entry for the next :meth:`retry`."""
        self.unacked += deliveries
        self.retry()

    def retry(self) -> None:
        """XACK every entry not yet acked; those Redis refuses stay for the next try."""
        if not self.unacked:
            return
        todo, self.unacked = self.unacked, []
        pipe = self.member.redis.pipeline(transaction=False)
        for delivery in todo:
            pipe.xack(self.member.stream(delivery), CONSUMER_GROUP, delivery.entry_id)
        try:
            answers = pipeline_replies(pipe)
        except REDIS_DOWN:
            self.unacked = todo + self.unacked
            raise
        for delivery, reply in zip(todo, answers, strict=True):
            if isinstance(reply, redis.ResponseError):
                log.warning("ack of entry %s refused: %s", delivery.entry_id, reply)
                self.unacked.append(delivery)

    def hand_back(self, jobs: list[Job], *, idle_ms: int) -> None:
        """Mark handed-back entries claimable at once (idle ``idle_ms``), and uncount this
        delivery: a graceful stop is not a crash, so it does not bring a job nearer to
        poison."""
        if not jobs:
            return
        pipe = self.member.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xclaim(
                self.member.stream(job.delivery),
                CONSUMER_GROUP,
                self.member.consumer,
                0,
                [job.delivery.entry_id],
                idle=idle_ms,
                retrycount=max(0, job.delivery.deliveries - 1),
                justid=True,
            )
        for job, reply in zip(jobs, pipeline_replies(pipe), strict=True):
            if isinstance(reply, redis.ResponseError):
                log.warning("job %s: not handed back (%s); claimable later", job.job_id, reply)
