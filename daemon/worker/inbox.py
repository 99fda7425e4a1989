"""Where every delivery comes into the daemon, whoever found it.

A queue entry reaches this daemon by a read (piggybacked on a publish, or an idle
daemon's own), a claim of a dead daemon's entry, a stray of its own (a lost
reply), its own pending entries at start, or a job taken back after Redis lost
its writes (also an ended one: batchd.daemon.fleet.durable). Each is picked up
(batchd.daemon.worker.pickup: what the entry is),
the jobs to run or to end go to the held jobs (batchd.daemon.worker.held), and
the entries left over are acked (batchd.daemon.worker.acks) — one way, in one
place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from batchd.config.settings import Settings
from batchd.daemon.fleet.durable import DurabilityWatch
from batchd.daemon.fleet.housekeeping import trim_acked
from batchd.daemon.fleet.recovery import Recovery
from batchd.daemon.fleet.sweep import Sweep
from batchd.daemon.worker.acks import Acks
from batchd.daemon.worker.held import HeldJobs
from batchd.daemon.worker.intake import Intake
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.pickup import Encode, PickupPolicy
from batchd.daemon.worker.redis_io import REDIS_DOWN, Backoff
from batchd.producers.keys import lanes

log = logging.getLogger(__name__)


class Inbox:
    """Deliveries in: read, claimed or taken back; picked up; held or acked. Errors of an
    unreachable or refusing Redis go to ``backoff``."""

    def __init__(
        self,
        member: Member,
        settings: Settings,
        *,
        encode: Encode,
        held: HeldJobs,
        backoff: Backoff,
    ) -> None:
        opts = settings.daemon
        self.member = member
        self.queues = lanes(list(settings.queues))  # priority lanes first
        self.held = held
        self.backoff = backoff
        self.reader = Intake(member, self.queues)
        self.pickup = PickupPolicy(
            member, limits=settings.limits, max_deliveries=opts.max_deliveries, encode=encode
        )
        self.recovery = Recovery(
            member, heartbeat_ttl_s=opts.heartbeat_ttl_s, stall_timeout_s=opts.stall_timeout_s
        )
        self.acks = Acks(member)
        self.durable = DurabilityWatch(member, result_ttl_s=settings.result_ttl_s)
        self.sweep = Sweep(
            member,
            heartbeat_ttl_s=opts.heartbeat_ttl_s,
            stall_timeout_s=opts.stall_timeout_s,
            result_ttl_s=settings.result_ttl_s,
        )
        # The last claim failure logged: a failure that repeats every interval is logged once.
        self.claim_error: str | None = None

    def take_own(self) -> None:
        """At start: take in this consumer's own pending entries (a restart under a stable
        name). Raises Redis errors."""
        for queue, partition in self.member.partitions(self.queues):
            self.admit(self.recovery.own_pending(queue, partition))

    def intake(self, *, idle: Callable[[], bool], block_ms: int) -> None:
        """Pick up what the last publish read; then, if ``idle()`` (nothing held, nothing
        to step, not stopping), block on a read of its own for up to ``block_ms``."""
        if not self.backoff.ready():
            return
        try:
            self.reader.raise_failure()
            read = self.reader.take()
            self.admit(read)
            room = self.held.room()
            if idle() and room > 0:
                self.reader.read(self.member.redis, count=room, block_ms=block_ms)
                self.admit(self.reader.take())
            elif not read:
                return
            self.backoff.succeeded()
        except REDIS_DOWN as exc:
            self.backoff.failed(exc, doing="reading jobs")
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                # READONLY, OOM, NOPERM...: read nothing new until Redis serves again.
                self.backoff.failed(exc, doing="reading jobs")
                return
            # The group is gone: Redis restarted without persistence, or someone deleted it.
            log.error("consumer group missing (%s); creating it again", exc)
            self.member.create_groups(self.queues)

    def claim(self, *, take_over: bool = True) -> None:
        """Acks left to retry, ended jobs whose end Redis lost (picked up again), this
        daemon's strays, dead daemons' entries (up to the room left; none unless
        ``take_over``: a paused daemon takes no new job), and housekeeping (trimming
        acked entries, forgetting dead consumers, the sweep of ``running`` jobs nothing
        will run: batchd.daemon.fleet.sweep)."""
        try:
            self.acks.retry()
            self.reader.put_back(self.durable.lost())
            self.recovery.liveness.refresh()
            for queue, k in self.member.partitions(self.queues):
                self.admit(self.recovery.strays(queue, k, held=self._accounted()))
                if take_over:
                    self.admit(self.recovery.claim(queue, k, limit=self.held.room()))
                stream = self.member.keys.queue(queue, k)
                trim_acked(self.member.redis, stream, keys=self.member.keys)
                self.recovery.forget_dead(queue, k)
            self.sweep.run(held=self._accounted())
        except REDIS_DOWN as exc:
            self.backoff.failed(exc, doing="claiming jobs of dead daemons")
        except redis.ResponseError as exc:
            # E.g. a server without Lua (fakeredis) or an ACL forbidding EVALSHA: serve
            # without taking over dead daemons' jobs rather than not at all.
            if str(exc) != self.claim_error:
                log.error("claiming jobs of dead daemons failed: %s", exc)
            self.claim_error = str(exc)

    def take_back(self, jobs: list[Job]) -> None:
        """Read again the entries of jobs whose stream Redis lost writes of, where they are
        still this daemon's (Recovery.take_back); the pickup starts them over from what
        the stream holds."""
        for job in jobs:
            try:
                mine = self.recovery.take_back(job.delivery, job.job_id)
            except (*REDIS_DOWN, redis.ResponseError):
                mine = True  # decided at the pickup, which reads what Redis holds
            if mine:
                self.reader.put_back([job.delivery])

    def hand_back(self, jobs: list[Job]) -> None:
        """At a graceful stop: the acks left, and ``jobs``' entries claimable at once."""
        self.acks.retry()
        self.acks.hand_back(jobs, idle_ms=self.recovery.min_idle_ms)

    def admit(self, deliveries: list[Delivery]) -> None:
        """Pick up deliveries and hold the jobs they make; ack what is not to run.
        Raises REDIS_DOWN errors, the deliveries put back for the next try."""
        if not deliveries:
            return
        try:
            pickup = self.pickup.pick_up(deliveries)
        except REDIS_DOWN:
            self.reader.put_back(deliveries)
            raise
        self.acks.ack(self.held.admit(pickup))

    def _accounted(self) -> set[str]:
        """Entry ids this daemon accounts for: its jobs, reads not yet picked up, acks due."""
        held = self.held.entries()
        held.update(d.entry_id for d in self.reader.pending())
        held.update(d.entry_id for d in self.acks.unacked)
        held.update(self.durable.entries())
        return held
