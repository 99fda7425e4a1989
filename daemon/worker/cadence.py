"""When the daemon publishes, and the one publish pipeline in flight.

A publish (the jobs' tokens, statuses and acks, plus the cancellation read and
the intake read, see batchd.daemon.worker.intake) is one pipeline, one round
trip. Where the engine computes off the CPU (a GPU), a thread of its own
executes it while the next step runs, so a busy step waits for no round trip:
step N's pipeline is in flight while step N+1 computes and is settled right
after it (jobs read and cancellations seen by it take effect at step N+2); only
new jobs' pickup adds a round trip, and only an idle daemon blocks on Redis. An
engine on the CPU (``Generator.steps_use_cpu``) keeps every core busy: there the
daemon waits for the replies between steps, as it does after short steps
(OVERLAP_MIN_STEP_S) and while idle. (Run beside the step, the pipeline's
Python, Redis running it and the subscribers it wakes take cores from the
engine's threads mid-step, which wait for each other: on 2 cores that cost the
daemon more than the round trip it hid, see docs/bench/HISTORY.md.) At most one
pipeline is in flight, and no other Redis command of the engine thread runs
meanwhile, so Redis sees the daemon's commands in the order of a loop that waits
for every reply.

While busy, every job's outbox goes out at most each ``daemon.publish_interval_ms``
(unset: CPU_PUBLISH_INTERVAL_MS on the CPU, else every step); between, only
outboxes someone waits on (Job.urgent), with the acks of finished jobs riding along.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.publisher import Flush, FlushResult, Piggyback, Publisher
from batchd.daemon.worker.redis_io import REDIS_DOWN, Backoff

# After a step shorter than this the pipeline is settled at once instead of during the next
# step: a short step is mostly Python, which holds the GIL, so the publishing thread would
# wait up to Python's switch interval for it, twice, to hide one round trip. Overlap pays
# only with longer steps (figures: docs/bench/HISTORY.md, "Figures behind the code's
# choices"). An engine on the CPU is never overlapped (Generator.steps_use_cpu); revisit
# when a GPU's step times are measured.
OVERLAP_MIN_STEP_S = 0.010

# Where the engine computes on the CPU and ``daemon.publish_interval_ms`` is unset: each
# publish stops the engine for its round trip, and Redis and the followers it wakes take
# cores from the next step, so tokens between a job's first and last go out at most this
# often (the queue rounds that chose it: docs/bench/HISTORY.md, "Figures behind the
# code's choices"); steps at least this long publish as before. Revisit if the publish
# leaves the engine's thread.
CPU_PUBLISH_INTERVAL_MS = 100


class PublishCadence:
    """Decides which outboxes a publish carries, sends it (beside the next step or not)
    and settles it. Errors of an unreachable Redis go to ``backoff``."""

    def __init__(
        self,
        publisher: Publisher,
        backoff: Backoff,
        *,
        interval_ms: int | None,
        steps_use_cpu: bool,
        on_published: Callable[[float], None],
    ) -> None:
        """``on_published`` gets the engine thread's seconds spent on each publish:
        building the pipeline, waiting for its replies where it waits, applying them."""
        self.publisher = publisher
        self.backoff = backoff
        self.steps_use_cpu = steps_use_cpu
        if interval_ms is None:
            interval_ms = CPU_PUBLISH_INTERVAL_MS if steps_use_cpu else 0
        self.interval_s = interval_ms / 1000
        self.published_all_at = 0.0
        self.on_published = on_published
        # The pipeline in flight (at most one), executed by the publishing thread, and the
        # seconds the engine thread has spent on it so far (building it).
        self._in_flight: tuple[Flush, Future[list[Any]], float] | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchd-publish")

    @property
    def in_flight(self) -> bool:
        """A pipeline is sent and its replies not yet applied (the step runs meanwhile)."""
        return self._in_flight is not None

    def due(
        self, jobs: Mapping[str, Job], *, working: bool, backlog: bool
    ) -> Collection[Job] | None:
        """The jobs this publish sends: every job once the publish interval has passed
        since the last publish of all of them, or while the engine has nothing to step
        (not ``working``); else the urgent ones (Job.urgent) with the acks left to send,
        or None when none is urgent. An ack alone is urgent only while the last intake
        read left entries waiting (``backlog``), for the room it frees. Only a publish of
        every job restarts the interval, so jobs that end often never hold the others
        back."""
        now = time.monotonic()
        interval_passed = now - self.published_all_at >= self.interval_s
        if not jobs or interval_passed or not working:
            self.published_all_at = now
            return jobs.values()
        due: list[Job] = []
        urgent = False
        for job in jobs.values():
            if job.urgent:
                urgent = True
                due.append(job)
            elif job.stored_final:
                due.append(job)
        return due if urgent or (due and backlog) else None

    def send(
        self, jobs: Collection[Job], extras: Sequence[Piggyback], *, step_s: float
    ) -> FlushResult | None:
        """Send one pipeline of ``jobs``' outboxes and the ``extras``. Returns its result
        when it is settled at once (on the CPU, after a step shorter than
        OVERLAP_MIN_STEP_S, while idle, or when it sent nothing); None while it is in
        flight (:meth:`settle` returns it after the next step) or Redis is away."""
        began = time.perf_counter()
        try:
            prepared = self.publisher.prepare(jobs, extras=extras)
        except REDIS_DOWN as exc:
            self.backoff.failed(exc, doing="publishing")
            return None
        if isinstance(prepared, FlushResult):
            return prepared
        if self.steps_use_cpu or step_s < OVERLAP_MIN_STEP_S:
            result = self._settle(prepared, prepared.execute)
            self.on_published(time.perf_counter() - began)
            return result
        future = self._thread.submit(prepared.execute)
        self._in_flight = (prepared, future, time.perf_counter() - began)
        return None

    def settle(self) -> FlushResult | None:
        """Wait for the pipeline in flight, if any: what Redis confirmed of it."""
        if self._in_flight is None:
            return None
        flush, replies, spent_s = self._in_flight
        self._in_flight = None
        began = time.perf_counter()
        result = self._settle(flush, replies.result)
        self.on_published(spent_s + time.perf_counter() - began)
        return result

    def close(self) -> None:
        """Stop the publishing thread (settle first: nothing may be in flight)."""
        assert self._in_flight is None, "close() with a pipeline in flight"
        self._thread.shutdown()

    def _settle(self, flush: Flush, replies: Callable[[], list[Any]]) -> FlushResult | None:
        try:
            return self.publisher.settle(flush, replies())
        except REDIS_DOWN as exc:
            self.backoff.failed(exc, doing="publishing")
            return None
