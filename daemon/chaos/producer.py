"""The run's producer: submits the seeded jobs (client and bare XADD), duplicates some,
cancels some, sends hostile entries, and does what a careful producer does when Redis
loses its writes: submits again what Redis no longer knows.

It keeps at most ``window`` jobs outstanding, as a real producer with a bounded
backlog would, so a job waits in the queue seconds, not the whole run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import orjson
import redis

from batchd.daemon.chaos.background import Background
from batchd.daemon.chaos.hostile import HostileSource
from batchd.daemon.chaos.ledger import HostileSend, Ledger
from batchd.daemon.chaos.workload import CancelAt, ChaosJob, Via
from batchd.producers.client import Client
from batchd.producers.connection.factory import redis_client
from batchd.producers.errors import JobNotFound, ValidationError
from batchd.producers.follow import RECONNECT_ERRORS
from batchd.producers.keys import DEFAULT_QUEUE, JOB_FIELD, Keys

log = logging.getLogger(__name__)

T = TypeVar("T")
# What a write meets while a fault is on: the retry waits it out.
TRANSIENT = (
    *RECONNECT_ERRORS,  # LOADING after a restart, a Redis Cluster changing hands included
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
)
RETRY_PAUSE_S = 0.2


class Producer(Background):
    def __init__(
        self,
        url: str,
        ledger: Ledger,
        jobs: list[ChaosJob],
        *,
        keys: Keys,
        hostile: int,
        seed: int,
        window: int,
        follow: Callable[[str], None],
        may_submit: Callable[[int], bool],
        result_ttl_s: float,
    ) -> None:
        super().__init__("chaos-producer", join_timeout_s=60)
        self.ledger = ledger
        self.jobs = {job.id: job for job in jobs}
        self.order = jobs
        self.hostile_every = max(1, len(jobs) // hostile) if hostile else 0
        self.hostile_left = hostile
        self.hostile_source = HostileSource(seed)
        self.window = window
        self.follow = follow
        self.may_submit = may_submit
        self.result_ttl_s = result_ttl_s
        self.keys = keys
        # Socket timeouts shorter than the Redis pause fault, so it is felt as a timeout.
        self.redis = redis_client(url, socket_timeout=3.0, socket_connect_timeout=3.0)
        self.client = Client(self.redis, block_ms=200)

    def work(self) -> None:
        for i, job in enumerate(self.order):
            self._wait_for_room(i)
            if self.stop.is_set():
                return
            self._submit(job)
            if self.hostile_every and i % self.hostile_every == 0 and self.hostile_left:
                self._send_hostile()
            if i % 97 == 0:
                self._cancel_unknown(i)
        while self.hostile_left and not self.stop.is_set():
            self._send_hostile()

    def _wait_for_room(self, index: int) -> None:
        while not self.stop.is_set():
            if not self.may_submit(index):
                time.sleep(0.02)
                continue
            with self.ledger.lock:
                outstanding = len(self.ledger.submitted) - len(self.ledger.finished_at)
            if outstanding < self.window:
                return
            time.sleep(0.02)

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        while True:
            try:
                return call()
            except TRANSIENT as exc:
                log.debug("%s: %s; retrying", what, exc)
                if self.stop.wait(RETRY_PAUSE_S):
                    raise

    # -- jobs -------------------------------------------------------------------------------

    def _submit(self, job: ChaosJob) -> None:
        with self.ledger.lock:
            self.ledger.submitted.add(job.id)
        self._enqueue(job)
        self.follow(job.id)
        if job.duplicate:
            self._duplicate(job)
        if job.cancel is CancelAt.queued and job.via is Via.client:
            self.cancel(job.id, expect=None)

    def _enqueue(self, job: ChaosJob, *, idempotent: bool = True) -> None:
        if job.via is Via.client or idempotent is False:
            self._retry(
                f"submit {job.id}",
                lambda: self.client.submit_request(job.payload, idempotent=idempotent),
            )
        else:
            body = orjson.dumps(job.payload)
            queue = self.keys.queue_for(DEFAULT_QUEUE, job.id)
            self._retry(
                f"xadd {job.id}",
                lambda: self.redis.xadd(queue, {JOB_FIELD: body}),
            )

    def _duplicate(self, job: ChaosJob) -> None:
        """A second submit of the same id: the client must refuse it; a second bare entry
        must be acked without running the job again."""
        if job.via is Via.xadd:
            self._enqueue(job)
            return
        try:
            self._enqueue(job, idempotent=False)
        except ValidationError:
            return
        if not self.ledger.cuts:  # only a Redis that lost the first submit may take it
            self.ledger.wrong(f"a second submit of {job.id} was taken")

    def resubmit(self, job_id: str) -> None:
        """The job is gone from Redis (its submit was in the second a crash lost)."""
        with self.ledger.lock:
            self.ledger.resubmitted.add(job_id)
        log.info("job %s lost with Redis: submitted again", job_id)
        job = self.jobs[job_id]
        self._retry(
            f"resubmit {job_id}",
            lambda: self.client.submit_request(job.payload, idempotent=True),
        )

    # -- cancels ----------------------------------------------------------------------------

    def cancel(self, job_id: str, *, expect: bool | None) -> None:
        """Ask to cancel; ``expect`` is the answer it must give (None: either)."""
        try:
            answer = self._retry(f"cancel {job_id}", lambda: self.client.cancel(job_id))
        except JobNotFound:
            if not self.ledger.cuts:
                self.ledger.wrong(f"cancel of submitted job {job_id}: JobNotFound")
            return
        with self.ledger.lock:
            self.ledger.cancel_answers[job_id] = answer
        if expect is not None and answer is not expect and not self.ledger.cuts:
            self.ledger.wrong(f"cancel of {job_id} answered {answer}, expected {expect}")

    def _cancel_unknown(self, i: int) -> None:
        job_id = f"chaos-unknown-{i}"
        try:
            answer = self._retry(f"cancel {job_id}", lambda: self.client.cancel(job_id))
        except JobNotFound:
            with self.ledger.lock:
                self.ledger.unknown_cancels += 1
            return
        self.ledger.wrong(f"cancel of unknown job {job_id} answered {answer}")

    # -- hostile entries --------------------------------------------------------------------

    def _send_hostile(self) -> None:
        recent = self.ledger.finished_within(self.result_ttl_s / 4)
        entry = self.hostile_source.entry(recent)
        self.hostile_left -= 1
        self._xadd_hostile(entry)

    def _xadd_hostile(self, entry: dict[str, bytes]) -> None:
        # All to partition 0's stream: their entry ids, which dead letters name, stay
        # unique (two streams may give the same id).
        try:
            entry_id: Any = self.redis.xadd(self.keys.queue(), entry)  # type: ignore[arg-type]
        except TRANSIENT:
            # Sent or not, nobody can say: it is not resent (that could make two).
            with self.ledger.lock:
                self.ledger.hostile_unanswered += 1
            return
        with self.ledger.lock:
            self.ledger.hostile.append(HostileSend(entry_id.decode(), time.monotonic(), entry))

    def after_redis_crash(self, since: float) -> None:
        """Send again the hostile entries the crash lost (acknowledged after ``since``).

        The queue is read before the dead letters: an entry handled in between is then
        found in the second read, never missed by both."""
        with self.ledger.lock:
            at_risk = [send for send in self.ledger.hostile if send.sent_at >= since]
        queue = self.keys.queue()
        lost = []
        for send in at_risk:
            found: Any = self._retry(
                "read", partial(self.redis.xrange, queue, send.entry_id, send.entry_id)
            )
            if not found:
                lost.append(send)
        if not lost:
            return
        handled = set()
        for dead in self.keys.dead_streams():
            letters: Any = self._retry("read dead letters", partial(self.redis.xrange, dead))
            handled |= {fields.get(b"entry", b"").decode() for _, fields in letters}
        lost = [send for send in lost if send.entry_id not in handled]
        with self.ledger.lock:
            self.ledger.hostile = [s for s in self.ledger.hostile if s not in lost]
            self.ledger.hostile_lost.update(send.entry_id for send in lost)
        for send in lost:
            self._xadd_hostile(send.entry)
