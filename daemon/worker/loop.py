"""The daemon's loop: step, settle, intake, control, claims at their own interval, publish.

Everything here runs on one thread, the engine thread (MLX streams are thread-local);
the heartbeat has a thread (and a connection) of its own. A publish (the jobs' tokens,
statuses and acks, plus the cancellation read and the intake read, see
batchd.daemon.worker.intake) is one pipeline, one round trip. Where the engine computes off the
CPU (a GPU), a thread of its own executes it while the next step runs, so a busy step
waits for no round trip: step N's pipeline is in flight while step N+1 computes and is
settled right after it (jobs read and cancellations seen by it take effect at step N+2);
only new jobs' pickup adds a round trip, and only an idle daemon blocks on Redis. An
engine on the CPU (``Generator.steps_use_cpu``) keeps every core busy: there the loop
waits for the replies between steps, as it does after short steps (OVERLAP_MIN_STEP_S)
and while idle. (Run beside the step, the pipeline's Python, Redis running it and the
subscribers it wakes take cores from the engine's threads mid-step, which wait for each
other: on 2 cores that cost the daemon more than the round trip it hid, see
docs/bench/HISTORY.md.) No Redis command of this thread runs while a pipeline is in
flight, so Redis sees the daemon's commands in the order of a loop that waits for every
reply. While busy, every job's outbox goes out at most each
``daemon.publish_interval_ms`` (unset: CPU_PUBLISH_INTERVAL_MS on the CPU, else every
step); between, only outboxes someone waits on (Job.urgent), with the acks of finished
jobs riding along.
Signals set a flag: intake stops, running jobs get the grace period to
finish, the rest stay pending in the group (their published events are the
checkpoint), and ``run`` returns.

While Redis is away the engine keeps stepping: new tokens wait in each job's
outbox, in order, and the publisher retries with backoff (capped at
``daemon.redis_retry_max_s``); intake, cancellations and claims wait for it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from batchd.config.settings import Settings
from batchd.daemon.fleet.heartbeat import Heartbeat
from batchd.daemon.fleet.housekeeping import trim_acked
from batchd.daemon.fleet.recovery import Recovery
from batchd.daemon.ops.observer import Ops, StepDone
from batchd.daemon.worker import crashpoint
from batchd.daemon.worker.acks import Acks
from batchd.daemon.worker.control import Cancellations
from batchd.daemon.worker.generator import Generator, JobRejected, JobStart, StepView, TokenOut
from batchd.daemon.worker.intake import Intake
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.metrics import Meter
from batchd.daemon.worker.pickup import PickupPolicy
from batchd.daemon.worker.publisher import Flush, FlushResult, Piggyback, Publisher
from batchd.daemon.worker.redis_io import (
    REDIS_DOWN,
    REDIS_REFUSING,
    Backoff,
    connect,
    refuse_cluster,
)
from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import FinishReason

log = logging.getLogger(__name__)

# Exit status of a daemon whose engine stalled (EX_SOFTWARE).
EXIT_STALLED = 70

# After a step shorter than this the pipeline is settled at once instead of during the next
# step: a short step is mostly Python, which holds the GIL, so the publishing thread would
# wait up to Python's switch interval (5 ms) for it, twice, to hide a ~2 ms round trip.
# Measured on 2 cores with 8-token jobs on the tiny model (3.4 ms steps): overlapping them
# cut the daemon's requests/s by ~20%; on bench-small (20-60 ms steps, when OpenBLAS ran the
# products) it raised its throughput through Redis by 9% (median of ten alternating pairs,
# see docs/bench/HISTORY.md). An engine on the CPU is never overlapped now
# (Generator.steps_use_cpu).
OVERLAP_MIN_STEP_S = 0.010

# Where the engine computes on the CPU and ``daemon.publish_interval_ms`` is unset: each
# publish stops the engine for its round trip (~1 ms for 32 jobs on 2 cores, Redis's
# script runs included), and Redis and the followers it wakes take cores from the next
# step, so tokens between a job's first and last go out at most this often. bench-small
# (15-25 ms steps) through Redis: 0.978x in-process against 0.918x publishing every step
# (medians of 6 alternating queue rounds), and 1.01x at 100 ms against 0.98x at 50 ms
# (medians of 12 rounds in four queue-only runs alternating the two: 80 publishes a run
# instead of 110); steps of 100 ms or more publish as before.
CPU_PUBLISH_INTERVAL_MS = 100

# How often the loop refreshes the heartbeat's figures (written every heartbeat interval,
# a second by default): computing them each turn cost ~30 us, 0.2% of bench-small's steps.
FIGURES_EVERY_S = 0.1

StepObserver = Callable[[StepView | None, list[TokenOut]], None]


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
        self.keys = Keys(settings.key_prefix)
        self.queues = list(settings.queues)
        self.redis = connect(settings)
        opts = settings.daemon
        self.jobs: dict[str, Job] = {}
        self.publisher = Publisher(
            self.redis, self.keys, owner=consumer, result_ttl_s=settings.result_ttl_s
        )
        # The pipeline in flight (at most one), executed by the publishing thread, and the
        # seconds this thread has spent on it so far (building it).
        self._in_flight: tuple[Flush, Future[list[Any]], float] | None = None
        self._publishing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchd-publish")
        member = Member(self.redis, self.keys, consumer)
        self.pickup = PickupPolicy(
            member,
            limits=settings.limits,
            max_deliveries=opts.max_deliveries,
            encode=generator.encode,
        )
        self.recovery = Recovery(
            member, heartbeat_ttl_s=opts.heartbeat_ttl_s, stall_timeout_s=opts.stall_timeout_s
        )
        self.cancels = Cancellations(self.keys)
        self.intake_reader = Intake(self.keys, self.queues, consumer=consumer)
        self.backoff = Backoff(cap_s=opts.redis_retry_max_s)
        self.heartbeat = Heartbeat(
            connect(settings),
            self.keys.daemon(consumer),
            interval_s=opts.heartbeat_interval_s,
            ttl_s=opts.heartbeat_ttl_s,
            info={"consumer": consumer, "model": settings.model, "queues": self.queues},
            stall_timeout_s=opts.stall_timeout_s,
            on_stall=self._stalled,
        )
        # When the engine last made progress: its last completed step, or now while idle.
        self.last_step_at = time.time()
        # How long the last step took (0 while idle): decides whether publishing overlaps.
        self.last_step_s = 0.0
        # How often every job's outbox is sent while busy, and when it last was.
        interval_ms = opts.publish_interval_ms
        if interval_ms is None:
            interval_ms = CPU_PUBLISH_INTERVAL_MS if generator.steps_use_cpu else 0
        self.publish_interval_s = interval_ms / 1000
        self.published_all_at = 0.0
        self.figures_due = 0.0
        self.meter = Meter()
        self.stopping = False
        self.deadline = float("inf")
        self.next_claim = 0.0
        self.acks = Acks(member)
        # The last claim failure logged: a failure that repeats every interval is logged once.
        self.claim_error: str | None = None

    # -- control from outside (signal handlers, the demo) ---------------------------------

    def request_stop(self) -> None:
        """First call: stop intake, give running jobs the grace period. Second: stop now."""
        if self.stopping:
            self.deadline = 0.0
            return
        self.stopping = True
        self.deadline = time.monotonic() + self.settings.daemon.grace_period_s
        self.ops.stopping(self.jobs)
        log.info(
            "stopping: intake closed, %d job(s) get %.0fs to finish",
            len(self.jobs),
            self.settings.daemon.grace_period_s,
        )

    @property
    def pipeline_in_flight(self) -> bool:
        """A publish pipeline is sent and its replies not yet applied (the step runs
        meanwhile)."""
        return self._in_flight is not None

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

    def _done(self) -> bool:
        if not self.stopping:
            return False
        return not self.jobs or time.monotonic() >= self.deadline

    def intake(self) -> None:
        """Pick up what the last publish read; an idle daemon blocks on a read of its own.

        Entries already read are pending for this daemon, so they are picked up
        even while stopping (and handed back by ``_leave`` if unfinished).
        """
        if not self.backoff.ready():
            return
        try:
            self.intake_reader.raise_failure()
            read = self.intake_reader.take()
            self._admit(read)
            room = self._room()
            idle = not self.jobs and not self.gen.has_work()
            if idle and room > 0 and not self.stopping:
                self.intake_reader.read(
                    self.redis, count=room, block_ms=self.settings.daemon.block_ms
                )
                self._admit(self.intake_reader.take())
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
            for queue in self.queues:
                self._create_group(queue)

    def control(self) -> None:
        """Apply cancellations read along with the last publish: abort, free, final event."""
        for job_id in self.cancels.take():
            job = self.jobs.get(job_id)
            if job is None or not job.in_engine:
                continue
            self._out_of_engine(job)
            job.end(FinishReason.cancelled)
            log.info("job %s cancelled after %d token(s)", job_id, job.next_seq)

    def step(self) -> None:
        """One engine step; its tokens go to the jobs' outboxes."""
        if not self.gen.has_work():
            self.last_step_s = 0.0
            # Intake does not block while Redis is away: without this the loop would spin.
            if self.backoff.down:
                time.sleep(min(self.backoff.delay(), 0.1))
            return
        began = time.monotonic()
        outputs = self.gen.step()
        self.last_step_at = time.time()
        self.last_step_s = time.monotonic() - began
        view = self.gen.last_step()
        self.meter.step(view, len(outputs))
        self.ops.stepped(StepDone(view, outputs, self.last_step_s, self.jobs))
        crashpoint.reached("prefill" if view is not None and view.prefills else "decode")
        for out in outputs:
            job = self.jobs.get(out.job_id)
            if job is None:
                log.error("engine output for job %s, which is not held here; dropped", out.job_id)
                self._abort_quietly(out.job_id)
                continue
            if job.ended:  # failed alone while the engine still ran it
                self._out_of_engine(job)
                continue
            try:
                if out.token_id is not None:
                    job.add_token(
                        out.token_id,
                        out.text,
                        logprob=out.logprob,
                        top_logprobs=out.top_logprobs,
                        index=out.index,
                        prompt_logprobs=out.prompt_logprobs,
                    )
                if out.finish_reason is not None:
                    self._sequence_ended(job, out.index, out.finish_reason, out.error)
            except Exception as exc:  # one job's failure is that job's alone
                self._out_of_engine(job)
                job.fail("taking its output", exc)
        if self.on_step is not None:
            self.on_step(view, outputs)

    def publish(self) -> None:
        """Send one pipeline: the outboxes due (tokens, statuses, finishes; see ``_due``),
        new cancellations and, while busy, new jobs up to the room left once this
        pipeline's finishes are acked. Off the CPU it runs while the next step computes
        and ``settle`` applies its replies after it; with an engine on the CPU, after a
        step shorter than OVERLAP_MIN_STEP_S, and while idle, its replies are applied at
        once."""
        if not self.backoff.ready():
            return
        working = self.gen.has_work()
        jobs = self._due(working)
        if jobs is None:
            return
        began = time.perf_counter()
        extras: list[Piggyback] = [self.cancels]
        busy = bool(self.jobs) or working
        room = self._room(ending_now=True)
        if busy and room > 0 and not self.stopping and not self.backoff.down:
            self.intake_reader.count = room
            extras.append(self.intake_reader)
        try:
            prepared = self.publisher.prepare(jobs, extras=extras)
        except REDIS_DOWN as exc:
            self.backoff.failed(exc, doing="publishing")
            return
        if isinstance(prepared, FlushResult):
            self._apply(prepared)
            return
        if self.gen.steps_use_cpu or self.last_step_s < OVERLAP_MIN_STEP_S:
            self._settle(prepared, prepared.execute)
            self.ops.published(time.perf_counter() - began)
            return
        future = self._publishing.submit(prepared.execute)
        self._in_flight = (prepared, future, time.perf_counter() - began)

    def _due(self, working: bool) -> Collection[Job] | None:
        """The jobs this publish sends: every job once the publish interval has passed
        since the last publish of all of them, or while the engine has nothing to step
        (not ``working``); else the urgent ones (Job.urgent) with the acks left to send,
        or None when none is urgent. An ack alone is urgent only while the last intake
        read left entries waiting, for the room it frees. Only a publish of every job
        restarts the interval, so jobs that end often never hold the others back."""
        now = time.monotonic()
        interval_passed = now - self.published_all_at >= self.publish_interval_s
        if not self.jobs or interval_passed or not working:
            self.published_all_at = now
            return self.jobs.values()
        due: list[Job] = []
        urgent = False
        for job in self.jobs.values():
            if job.urgent:
                urgent = True
                due.append(job)
            elif job.stored_final:
                due.append(job)
        return due if urgent or (due and self.intake_reader.backlog) else None

    def settle(self) -> None:
        """Wait for the pipeline in flight, if any, and apply what Redis confirmed."""
        if self._in_flight is None:
            return
        flush, replies, spent_s = self._in_flight
        self._in_flight = None
        began = time.perf_counter()
        self._settle(flush, replies.result)
        self.ops.published(spent_s + time.perf_counter() - began)

    def _settle(self, flush: Flush, replies: Callable[[], list[Any]]) -> None:
        try:
            result = self.publisher.settle(flush, replies())
        except REDIS_DOWN as exc:
            self.backoff.failed(exc, doing="publishing")
            return
        self._apply(result)

    def _apply(self, result: FlushResult) -> None:
        """Act on a flush's result: finished jobs leave, lost ones are dropped, ones whose
        stream Redis lost are picked up again, and a refusal backs off."""
        if result.refused is None:
            self.backoff.succeeded()
        for job in result.finished:
            del self.jobs[job.key]
            self.meter.finished(job)
            self.ops.finished(job)
        for job in result.lost:
            log.error("job %s: another daemon owns it now; dropped here", job.job_id)
            self._out_of_engine(job)
            del self.jobs[job.key]
        for job in result.reconcile:
            # Redis lost writes (restart from an older snapshot, failover to a lagging
            # replica) or another daemon wrote: start over from what the stream holds.
            log.warning(
                "job %s: its events stream does not end at seq %d; picked up again from "
                "what Redis holds",
                job.job_id,
                job.stored_events,
            )
            self._out_of_engine(job)
            del self.jobs[job.key]
            try:
                mine = self.recovery.take_back(job.delivery, job.job_id)
            except (*REDIS_DOWN, redis.ResponseError):
                mine = True  # decided at the pickup, which reads what Redis holds
            if mine:
                self.intake_reader.put_back([job.delivery])
        if result.refused is not None:
            # Keep everything, stop intake and back off until Redis takes writes again.
            self.backoff.failed(redis.ResponseError(result.refused), doing="publishing")
        if result.published_events:
            crashpoint.reached("between_steps")

    def periodic(self) -> None:
        """Claims of dead daemons' jobs and housekeeping, and heartbeat figures."""
        now = time.monotonic()
        if now >= self.figures_due:
            self.figures_due = now + FIGURES_EVERY_S
            self.heartbeat.update(**self._figures())
        self.ops.tick(self)
        opts = self.settings.daemon
        # After an outage, live daemons need a heartbeat TTL to refresh their keys.
        settled = now - self.backoff.up_since >= opts.heartbeat_ttl_s
        if self.stopping or now < self.next_claim or self.backoff.down or not settled:
            return
        self.next_claim = now + opts.claim_interval_s
        try:
            self.acks.retry()
            for queue in self.queues:
                self._admit(self.recovery.strays(queue, held=self._held_entries()))
                self._admit(self.recovery.claim(queue, limit=self._room()))
                trim_acked(self.redis, self.keys.queue(queue))
                self.recovery.forget_dead(queue)
        except REDIS_DOWN as exc:
            self.backoff.failed(exc, doing="claiming jobs of dead daemons")
        except redis.ResponseError as exc:
            # E.g. a server without Lua (fakeredis) or an ACL forbidding EVALSHA: serve
            # without taking over dead daemons' jobs rather than not at all.
            if str(exc) != self.claim_error:
                log.error("claiming jobs of dead daemons failed: %s", exc)
            self.claim_error = str(exc)

    # -- helpers ----------------------------------------------------------------------------

    def _room(self, *, ending_now: bool = False) -> int:
        """Jobs the daemon may still read; ``ending_now`` leaves out jobs whose ack the
        coming publish carries (acked before its intake read)."""
        opts = self.settings
        jobs = self.jobs.values()
        # A job holds a running slot per sequence.
        held = sum(job.n for job in jobs if not (ending_now and job.stored_final))
        return opts.engine.max_num_seqs + opts.daemon.intake_buffer - held

    def _admit(self, deliveries: list[Delivery]) -> None:
        """Pick up deliveries: start runnable jobs, hold ended ones for publishing, ack dups."""
        if not deliveries:
            return
        try:
            pickup = self.pickup.pick_up(deliveries)
        except REDIS_DOWN:
            self.intake_reader.put_back(deliveries)
            raise
        for job in pickup.run + pickup.ended:
            held = self.jobs.get(job.job_id)
            if held is not None and held.delivery.entry_id == job.delivery.entry_id:
                continue  # the same delivery read again (a retried start): already running
            if held is not None and job.request is None:
                job.leave_untouched()  # a bad entry naming a job held here: dead letter only
            elif held is not None:
                log.warning(
                    "job %s is already held here; entry %s acked", job.job_id, job.delivery.entry_id
                )
                pickup.acks.append(job.delivery)
                continue
            self.jobs[job.key] = job
            if not job.ended:
                self._start(job)
        self.acks.ack(pickup.acks)

    def _sequence_ended(
        self, job: Job, index: int, reason: FinishReason, error: str | None
    ) -> None:
        """One sequence ended: the job ends with the last of its n, or at once on an error
        (its other sequences are dropped). The job's finish reason is sequence 0's."""
        if job.end_sequence(index, reason):
            job.in_engine = False
        elif reason is FinishReason.error:
            self._out_of_engine(job)
        else:
            return
        final = reason if reason is FinishReason.error else job.sequence(0).finish_reason
        job.end(final or reason, error=error)

    def _start(self, job: Job) -> None:
        """Admit each of the job's n sequences, resuming from its own stored tokens."""
        request = job.request
        assert request is not None
        try:
            for index in range(job.n):
                emitted = tuple(job.sequence(index).token_ids)
                done = self.gen.start(
                    JobStart(job.job_id, request, job.prompt_token_ids, emitted, index=index)
                )
                if done is None:
                    job.in_engine = True
                else:
                    self._sequence_ended(job, index, done, None)
        except JobRejected as exc:
            self._out_of_engine(job)
            job.reject(exc.reason)
            return
        except Exception as exc:  # one job's failure is that job's alone
            job.in_engine = False
            self._abort_quietly(job.job_id)
            job.fail("admitting it", exc)
            return
        if not job.ended:
            self.ops.started(job)
            if job.output_token_ids:
                log.info("job %s resumed at seq %d", job.job_id, job.next_seq)

    def _held_entries(self) -> set[str]:
        """Entry ids this daemon accounts for: its jobs, reads not yet picked up, acks due."""
        held = {job.delivery.entry_id for job in self.jobs.values()}
        held.update(d.entry_id for d in self.intake_reader.pending())
        held.update(d.entry_id for d in self.acks.unacked)
        return held

    def _stalled(self, silent_s: float) -> None:
        """Called on the heartbeat thread when the engine has had work and no completed
        step for ``daemon.stall_timeout_s``: the engine thread cannot be interrupted, so
        the process leaves its jobs to others (their events are the checkpoint) and exits
        non-zero for its supervisor to restart it."""
        log.critical(
            "engine stalled: work and no completed step for %.0fs; exiting (status %d) so "
            "that other daemons take over the jobs",
            silent_s,
            EXIT_STALLED,
        )
        self.heartbeat.remove()
        logging.shutdown()
        os._exit(EXIT_STALLED)

    def _abort_quietly(self, job_id: str) -> None:
        """Make sure the engine holds nothing of a job that failed half-way in; an engine
        that never had it may refuse the abort."""
        try:
            self.gen.abort(job_id)
        except Exception:
            log.debug("abort of job %s refused by the engine", job_id, exc_info=True)

    def _out_of_engine(self, job: Job) -> None:
        """Abort the job in the engine if it is there (cancelled, lost, handed back)."""
        if job.in_engine:
            self.gen.abort(job.job_id)
            job.in_engine = False

    def _figures(self) -> dict[str, Any]:
        load = self.gen.load()
        busy = self.gen.has_work()
        if not busy:
            self.last_step_at = time.time()
        return {
            "busy": busy,
            "last_step_at": self.last_step_at,
            "running": load.running,
            "waiting": load.waiting,
            "kv_usage": round(load.kv_usage, 4),
            "jobs_held": len(self.jobs),
            "tokens_per_s": round(self.meter.tokens_per_s(), 1),
            "jobs_done": dict(self.meter.jobs_finished),
            "redis_down": self.backoff.down,
            "stopping": self.stopping,
        }

    def _join(self) -> bool:
        """Check the server, take the heartbeat, create groups, take back own pending
        jobs; retry while Redis is away. False if asked to stop first. Raises
        ClusterUnsupported or ConsumerTaken when this daemon must not start."""
        while not self.stopping:
            try:
                refuse_cluster(self.redis)
                self.heartbeat.acquire()
                for queue in self.queues:
                    self._create_group(queue)
                self.cancels.start_at_end(self.redis)
                for queue in self.queues:
                    self._admit(self.recovery.own_pending(queue))
                self.backoff.succeeded()
                self.backoff.up_since -= self.settings.daemon.heartbeat_ttl_s
                self.heartbeat.start()
                return True
            except (*REDIS_DOWN, *REDIS_REFUSING) as exc:
                self.backoff.failed(exc, doing="starting")
                time.sleep(self.backoff.delay())
        return False

    def _create_group(self, queue: str) -> None:
        try:
            self.redis.xgroup_create(self.keys.queue(queue), CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _leave(self) -> None:
        """Hand back unfinished jobs (pending, checkpointed), store what is generated."""
        self.settle()
        self._publishing.shutdown()
        unfinished = [job for job in self.jobs.values() if job.in_engine]
        for job in unfinished:
            self._out_of_engine(job)
        try:
            # Two flushes: the final events, then (once confirmed) the acks.
            for _ in range(2):
                if self.jobs:
                    for job in self.publisher.flush(self.jobs.values()).finished:
                        del self.jobs[job.key]
            self.acks.retry()
            self.acks.hand_back(unfinished, idle_ms=self.recovery.min_idle_ms)
        except (*REDIS_DOWN, *REDIS_REFUSING) as exc:
            log.warning("could not store the last events (%s); they will be regenerated", exc)
        if unfinished:
            log.info("%d unfinished job(s) left pending for another daemon", len(unfinished))
        self.heartbeat.stop(remove=True)
        self.redis.close()
