"""The daemon's loop: step, settle, intake, control, claims at their own interval, publish.

Everything here runs on the engine thread (MLX streams are thread-local); the heartbeat
has a thread of its own, and a publish may run on the publishing thread while the next
step computes. The Worker keeps the loop, joining and leaving the group, and the
periodic work; each fact it acts on has one owner: deliveries come in through the
``Inbox``, the jobs held and their engine state are ``HeldJobs``', when outboxes go to
Redis is ``PublishCadence``'s. A delivery goes one way: read, picked up, held and
started, its outbox filled by steps and emptied by publishes, gone once its final
event and ack are stored. Signals set a flag: intake stops, running jobs get the grace
period to finish, the rest stay pending in the group (their published events are the
checkpoint), and ``run`` returns. An operator's pause closes intake only; a drain is
a stop whose jobs all get to finish (batchd.daemon.fleet.controls).

While Redis is away the engine keeps stepping: new tokens wait in each job's
outbox, in order, and the publisher retries with backoff (capped at
``daemon.redis_retry_max_s``); intake, cancellations and claims wait for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import redis

from batchd.config.settings import Settings
from batchd.daemon.fleet.controls import ControlWatch, Stop
from batchd.daemon.fleet.heartbeat import daemon_heartbeat
from batchd.daemon.fleet.poison import mark_alone
from batchd.daemon.ops.observer import Ops, StepDone
from batchd.daemon.worker.cadence import PublishCadence
from batchd.daemon.worker.control import Cancellations
from batchd.daemon.worker.generator import Generator
from batchd.daemon.worker.held import HeldJobs
from batchd.daemon.worker.inbox import Inbox
from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.metrics import Meter
from batchd.daemon.worker.publisher import FlushResult, Piggyback, Publisher
from batchd.daemon.worker.redis_io import REDIS_DOWN, REDIS_REFUSING, Backoff, claim_keys, connect
from batchd.engine.outputs import RequestOutput, StepStats
from batchd.producers.connection.layout import LayoutClaim
from batchd.producers.keys import lanes

log = logging.getLogger(__name__)

# How often the loop refreshes the heartbeat's figures (written every heartbeat interval,
# a second by default): computing them every turn is measurable on short steps.
FIGURES_EVERY_S = 0.1

StepObserver = Callable[[StepStats, list[RequestOutput]], None]


class Worker:
    """One daemon: a consumer in the group of each of its queues, driving one Generator."""

    def __init__(
        self,
        settings: Settings,
        generator: Generator,
        *,
        consumer: str,
        on_step: StepObserver | None = None,
        ops: Ops | None = None,
    ) -> None:
        self.settings = settings
        self.gen = generator
        self.consumer = consumer
        self.on_step = on_step
        self.ops = ops or Ops(model=settings.model)
        self.queues = lanes(list(settings.queues))  # priority lanes first
        self.redis = connect(settings)
        # The layout it serves, claimed at start (_join), kept stored by the heartbeat.
        self.layout = LayoutClaim.of(self.redis, settings.key_prefix, settings.queue.partitions)
        self.keys = self.layout.keys
        opts = settings.daemon
        self.meter = Meter()
        self.held = HeldJobs(
            generator,
            engine=settings.engine,
            queue=opts.intake_buffer,
            on_started=self.ops.started,
            on_finished=self._finished,
        )
        self.backoff = Backoff(cap_s=opts.redis_retry_max_s)
        self.cadence = PublishCadence(
            Publisher(self.redis, self.keys, owner=consumer, result_ttl_s=settings.result_ttl_s),
            self.backoff,
            interval_ms=opts.publish_interval_ms,
            steps_use_cpu=generator.steps_use_cpu,
            on_published=self.ops.published,
        )
        self.member = Member(self.redis, self.keys, consumer)
        self.held.mark_alone = partial(mark_alone, self.member)
        self.inbox = Inbox(
            self.member, settings, encode=generator.encode, held=self.held, backoff=self.backoff
        )
        self.cancels = Cancellations(self.keys, self.redis, held=self.held)
        self.controls = ControlWatch(connect(settings), self.keys.control(consumer))
        self.heartbeat = daemon_heartbeat(
            settings, self.controls, consumer, generator.max_model_len, self.layout
        )
        # When the engine last made progress: its last completed step, or now while idle.
        self.last_step_at = time.time()
        # How long the last step took (0 while idle): decides whether publishing overlaps.
        self.last_step_s = 0.0
        self.figures_due = 0.0
        self.stop = Stop()
        self.next_claim = 0.0

    # -- control from outside (signal handlers, the demo) ---------------------------------

    def request_stop(self, *, drain: bool = False) -> None:
        """First call: stop intake, give running jobs the grace period (``drain``: all the
        time they need). Second (not a drain): the grace period if draining, else stop now."""
        grace = self.settings.daemon.grace_period_s
        if not self.stop.request(drain=drain, grace_s=grace):
            return
        self.ops.stopping(self.held)
        wait = "all the time they need" if drain else f"{grace:.0f}s"
        what = "draining" if drain else "stopping"
        log.info("%s: intake closed, %d job(s) get %s to finish", what, len(self.held), wait)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until asked to stop; jobs not finished by then stay pending for others."""
        if not self._join():
            self.heartbeat.stop(remove=True)
            return
        log.info(
            "serving queues %s as consumer %s",
            self.queues,
            self.consumer,
            extra={"event": "serving", "consumer": self.consumer},
        )
        self.ops.ready(self)
        while not self._done():
            self.step()
            self.settle()
            self.intake()
            self.control()
            self.periodic()
            self.publish()
        self._leave()
        self.heartbeat.check_layout()  # LayoutMismatch: another layout was stored meanwhile

    def _idle(self) -> bool:
        return not (self.held or self.gen.has_work() or self.stop.stopping or self.controls.paused)

    def _done(self) -> bool:
        return self.stop.done(holding=bool(self.held))

    def step(self) -> None:
        """One engine step; its tokens go to the jobs' outboxes."""
        if not self.gen.has_work():
            self.last_step_s = 0.0
            # Intake does not block while Redis is away, paused or an end waits: no spin.
            if self.backoff.down or self.controls.paused or self.held.holding_ends():
                time.sleep(min(self.backoff.delay(), 0.1) if self.backoff.down else 0.1)
            return
        began = time.monotonic()
        outputs = self.gen.step()
        self.last_step_at = time.time()
        self.last_step_s = time.monotonic() - began
        stats = self.gen.stats()
        self.meter.step(stats, len(outputs))
        self.ops.stepped(StepDone(stats, outputs, self.last_step_s, self.held))
        self.held.take(outputs)
        if self.on_step is not None:
            self.on_step(stats, outputs)

    def settle(self) -> None:
        """Apply what Redis confirmed of the pipeline in flight, if any."""
        self._apply(self.cadence.settle())

    def intake(self) -> None:
        """Pick up what the last publish read; an idle daemon blocks on a read of its own.

        Entries already read are pending for this daemon, so they are picked up
        even while stopping (and handed back by ``_leave`` if unfinished).
        """
        self.inbox.intake(idle=self._idle, block_ms=self.settings.daemon.block_ms)

    def control(self) -> None:
        """Apply cancellations read along with the last publish: abort, free, final event;
        start held jobs whose turn came (a suspect waits for an empty engine)."""
        self.held.cancel(self.cancels.take())
        self.held.start_waiting()

    def periodic(self) -> None:
        """Claims of dead daemons' jobs and housekeeping, and heartbeat figures."""
        now = time.monotonic()
        if now >= self.figures_due:
            self.figures_due = now + FIGURES_EVERY_S
            busy = self.gen.has_work()
            if not busy:
                self.last_step_at = time.time()
            state = {"busy": busy, "last_step_at": self.last_step_at, "jobs_held": len(self.held)}
            state.update(redis_down=self.backoff.down, paused=self.controls.paused)
            state.update(stopping=self.stop.stopping, draining=self.stop.draining)
            self.heartbeat.update(**self.meter.figures(self.gen.stats(), **state))
        # A drain, or another layout stored meanwhile (heartbeat): held jobs finish, no more.
        if self.controls.requested.drain or self.heartbeat.layout_error:
            self.request_stop(drain=True)
        self.ops.tick(self)
        opts = self.settings.daemon
        # After an outage, live daemons need a heartbeat TTL to refresh their keys.
        settled = now - self.backoff.up_since >= opts.heartbeat_ttl_s
        if self.stop.stopping or now < self.next_claim or self.backoff.down or not settled:
            return
        self.next_claim = now + opts.claim_interval_s
        self.inbox.claim(take_over=not self.controls.paused)

    def publish(self) -> None:
        """Send one pipeline: the outboxes due (PublishCadence.due), new cancellations
        and, while busy, new jobs up to the room left once this pipeline's finishes are
        acked. It is settled now or, beside the next step, by ``settle``."""
        if not self.backoff.ready():
            return
        working = self.gen.has_work()
        jobs = self.cadence.due(self.held, working=working, backlog=self.inbox.reader.backlog)
        if jobs is None:
            return
        extras: list[Piggyback] = [self.cancels]
        room = self.held.room(ending_now=True)
        busy = bool(self.held) or working
        closed = self.stop.stopping or self.controls.paused or self.backoff.down
        if busy and room > 0 and not closed:
            self.inbox.reader.count = room
            extras.append(self.inbox.reader)
        self._apply(self.cadence.send(jobs, extras, step_s=self.last_step_s))

    def _apply(self, result: FlushResult | None) -> None:
        """Act on a settled publish: the held jobs take its confirmations, jobs whose
        stream Redis lost are read again, and a refusal backs off."""
        if result is None:
            return
        if result.refused is None:
            self.backoff.succeeded()
        self.inbox.take_back(self.held.settle(result))
        if result.refused is not None:
            # Keep everything, stop intake and back off until Redis takes writes again.
            self.backoff.failed(redis.ResponseError(result.refused), doing="publishing")

    def _finished(self, job: Job) -> None:
        """A job's final event, status and ack are stored: it is done here, once Redis has
        surely kept them (the durability watch picks it up again if not)."""
        self.inbox.durable.ended(job)
        self.meter.finished(job)
        self.ops.finished(job)

    # -- joining and leaving the group ------------------------------------------------------

    def _join(self) -> bool:
        """Check the server, claim the layout, take the heartbeat, create groups, take back
        own pending jobs; retry while Redis is away. False if asked to stop first. Raises
        LayoutError, ClusterUrlNeeded or ConsumerTaken when this daemon must not start, and
        redis.AuthenticationError for a login Redis refuses (no retry mends a password)."""
        while not self.stop.stopping:
            try:
                claim_keys(self.layout, self.redis, self.queues)  # self.keys: its keys
                self.heartbeat.acquire()
                self.member.create_groups(self.queues)
                self.cancels.start_at_end(self.redis)  # before the first pickup
                self.inbox.take_own()
                self.backoff.succeeded()
                self.backoff.up_since -= self.settings.daemon.heartbeat_ttl_s
                self.heartbeat.start()
                return True
            except (*REDIS_DOWN, *REDIS_REFUSING) as exc:
                if isinstance(exc, redis.AuthenticationError):
                    raise
                self.backoff.failed(exc, doing="starting")
                time.sleep(self.backoff.delay())
        return False

    def _leave(self) -> None:
        """Hand back unfinished jobs (pending, checkpointed), store what is generated."""
        self.settle()
        self.cadence.close()
        unfinished = self.held.stop_running()
        try:
            # Two flushes: the final events, then (once confirmed) the acks.
            for _ in range(2):
                if self.held:
                    self.held.settle(self.cadence.publisher.flush(self.held.values()))
            self.inbox.hand_back(unfinished)
        except (*REDIS_DOWN, *REDIS_REFUSING) as exc:
            log.warning("could not store the last events (%s); they will be regenerated", exc)
        if unfinished:
            log.info("%d unfinished job(s) left pending for another daemon", len(unfinished))
        if self.stop.draining:
            self.controls.drained()
        self.heartbeat.stop(remove=True)
        self.redis.close()
