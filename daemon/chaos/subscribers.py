"""The run's subscribers: follow every job's events to its final one, as clients do,
dropping their connection now and then and resuming from the last seq they had.

Each subscriber drives the producers' own :class:`~batchd.producers.follow.Follower`, so
what the run checks is what a client gets. A job the follower reports missing
(its submit was in the second a Redis crash lost) is submitted again and followed on
from where it was; a gap the follower refuses is recorded as a finding.
"""

from __future__ import annotations

import logging
import queue
import random

import redis

from batchd.config.cluster import is_cluster_url
from batchd.daemon.chaos.background import Background
from batchd.daemon.chaos.ledger import Ledger
from batchd.daemon.chaos.producer import Producer
from batchd.daemon.chaos.workload import CancelAt, ChaosJob
from batchd.producers.client import follow
from batchd.producers.connection.factory import redis_client
from batchd.producers.errors import JobNotFound, ProtocolError
from batchd.producers.follow import RECONNECT_ERRORS, Delivery, Follower
from batchd.producers.keys import Keys

log = logging.getLogger(__name__)

# A follower reports a job missing after this long without a status hash: past any
# fault's hold, so only a job Redis really lost is submitted again.
MISSING_AFTER_S = 10.0


class Subscriber(Background):
    def __init__(
        self,
        index: int,
        url: str,
        ledger: Ledger,
        producer: Producer,
        jobs: dict[str, ChaosJob],
        keys: Keys,
        *,
        seed: int,
        resume_every: int,
    ) -> None:
        super().__init__(f"chaos-sub-{index}", join_timeout_s=30)
        self.index = index
        self.url = url
        self.ledger = ledger
        self.producer = producer
        self.jobs = jobs
        self.keys = keys
        self.rng = random.Random(seed * 1000 + index)
        self.resume_every = resume_every
        self.inbox: queue.Queue[str] = queue.Queue()
        self.following: set[str] = set()
        self.follower: Follower | None = None

    def _connect(self) -> redis.Redis:
        return redis_client(self.url, socket_timeout=3.0, socket_connect_timeout=3.0)

    def _follower(self) -> Follower:
        follower = Follower(
            self.keys,
            cluster=is_cluster_url(self.url),  # reads then split by partition
            block_ms=200,
            status_interval_s=1.0,
            reconnect_timeout_s=120.0,
            retry_max_s=0.5,
            missing_timeout_s=MISSING_AFTER_S,
        )
        for job_id in self.following:
            follower.add(job_id, after_seq=len(self.ledger.delivered.get(job_id, [])) - 1)
        return follower

    def _take_new(self, follower: Follower) -> None:
        while True:
            try:
                job_id = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.following.add(job_id)
            follower.add(job_id)

    def work(self) -> None:
        while not self.stop.is_set():
            self._follow_once()

    def _follow_once(self) -> None:
        """One connection's worth of following: until a planned disconnect (the next
        connection starts a new follower from the last seqs, as a client that comes
        back would), a missing job, a refused stream, or (with nothing to follow) a
        short wait for new jobs."""
        follower = self.follower or self._follower()
        self.follower = follower
        self._take_new(follower)
        if not self.following:
            try:
                job_id = self.inbox.get(timeout=0.2)
            except queue.Empty:
                return
            self.following.add(job_id)
            follower.add(job_id)
        connection = self._connect()
        try:
            if self._drive(follower, connection):
                with self.ledger.lock:
                    self.ledger.resumes += 1
                self.follower = None
        except JobNotFound as exc:
            self.producer.resubmit(exc.job_id)
            # The other jobs' cursors keep their missing clocks: each lost job is found
            # after MISSING_AFTER_S, not one such wait after the other.
            follower.cursors[self.keys.events(exc.job_id)].missing_since = None
        except ProtocolError as exc:
            with self.ledger.lock:
                self.ledger.gaps[exc.job_id] = str(exc)
            self.following.discard(exc.job_id)
            self.follower = None
        except RECONNECT_ERRORS as exc:
            log.warning("subscriber %d: Redis unreachable too long (%s); resuming", self.index, exc)
            self.follower = None
        finally:
            connection.close()

    def _drive(self, follower: Follower, connection: redis.Redis) -> bool:
        """Follow on ``connection`` with the client's own driver; True at a planned
        disconnect. Jobs that arrived meanwhile join at each delivery."""
        until_drop = self.rng.randint(1, 2 * self.resume_every)
        for delivery in follow(connection, follower):
            self._deliver(delivery)
            self._take_new(follower)
            until_drop -= 1
            if until_drop == 0 or self.stop.is_set():
                return until_drop == 0
        return False

    def _deliver(self, delivery: Delivery) -> None:
        job_id, event = delivery
        self.ledger.deliver(job_id, event)
        job = self.jobs.get(job_id)
        if event.final:
            self.following.discard(job_id)
            if job is not None and job.cancel is CancelAt.finished:
                self.producer.cancel(job_id, expect=False)
        elif job is not None and job.cancel is not None and event.seq == 0:
            if job.cancel is not CancelAt.finished:
                self.producer.cancel(job_id, expect=None)
