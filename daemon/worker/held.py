"""The jobs a daemon holds, from pickup until Redis has their final event and ack.

``HeldJobs`` is the one owner of what the worker knows about its jobs: which it
holds, which of them the engine runs (starting each of a job's sequences, ending
the job with the last of them, aborting), what each step's outputs add to their
outboxes, what a flush's confirmations remove, and how much room is left for more
(the engine's capacity rule, ``EngineConfig.room``). A job's outbox itself is the
Job's (:mod:`batchd.daemon.worker.jobs`); getting it to Redis is the publisher's.

A delivery's path runs one way through here: ``admit`` (after pickup) -> ``take``
(each step's outputs) -> ``settle`` (each flush's result) -> gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from batchd.daemon.worker.generator import FINISH_REASONS, Generator, JobRejected, JobStart
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.pickup import Pickup
from batchd.daemon.worker.publisher import FlushResult
from batchd.engine.config import EngineConfig
from batchd.engine.outputs import RequestOutput
from batchd.producers.schema import FinishReason

log = logging.getLogger(__name__)

JobHook = Callable[[Job], None]


class HeldJobs(Mapping[str, Job]):
    """The held jobs by ``Job.key`` (read-only as a mapping), and their engine state."""

    def __init__(
        self,
        gen: Generator,
        *,
        engine: EngineConfig,
        queue: int,
        on_started: JobHook,
        on_finished: JobHook,
    ) -> None:
        """``queue``: sequences held beyond the engine's running slots (intake_buffer);
        ``on_started`` / ``on_finished``: a job entered the engine / its ack is stored."""
        self.gen = gen
        self.engine = engine
        self.queue = queue
        self.on_started = on_started
        self.on_finished = on_finished
        self._jobs: dict[str, Job] = {}
        # Held jobs not started yet, in order: a suspect waits until the engine is empty,
        # and everything behind it until it ends (batchd.daemon.fleet.poison).
        self._waiting: list[Job] = []
        # Records that a suspect starts alone (on its status hash); False: not now.
        self.mark_alone: Callable[[Job], bool] = lambda job: True
        # Keys of the jobs the engine holds sequences of (abort them to drop the job).
        self._running: set[str] = set()

    def __getitem__(self, key: str) -> Job:
        return self._jobs[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def room(self, *, ending_now: bool = False) -> int:
        """Sequences the daemon may still read (each of a job's n holds one);
        ``ending_now`` leaves out jobs whose ack the coming publish carries (acked before
        its intake read)."""
        if any(job.alone and not job.ended for job in self._jobs.values()):
            return 0  # a suspect runs alone: nothing more until it has ended
        # A held cancelled end (Job.final_held) is out of the engine: it takes no room.
        held = sum(
            job.n
            for job in self._jobs.values()
            if not ((ending_now and job.stored_final) or (job.ended and job.final_held()))
        )
        return self.engine.room(held=held, queue=self.queue)

    def holding_ends(self) -> bool:
        """Some held job's cancelled end waits to be durable (Job.final_held)."""
        return any(job.final_held() for job in self._jobs.values())

    def entries(self) -> set[str]:
        """The queue entries of the held jobs."""
        return {job.delivery.entry_id for job in self._jobs.values()}

    def admit(self, pickup: Pickup) -> list[Delivery]:
        """Hold what a pickup decided: start runnable jobs, keep ended ones for publishing.
        Returns the entries to ack: the pickup's, and new entries of jobs held already."""
        acks = list(pickup.acks)
        for job in pickup.run + pickup.ended:
            held = self._jobs.get(job.job_id)
            if held is not None and held.delivery.entry_id == job.delivery.entry_id:
                continue  # the same delivery read again (a retried start): already running
            if held is not None and job.request is None:
                job.leave_untouched()  # a bad entry naming a job held here: dead letter only
            elif held is not None:
                log.warning(
                    "job %s is already held here; entry %s acked", job.job_id, job.delivery.entry_id
                )
                acks.append(job.delivery)
                continue
            job.from_queue = True
            self._jobs[job.key] = job
            if not job.ended:
                self._waiting.append(job)
        self.start_waiting()
        return acks

    def start_waiting(self) -> None:
        """Start held jobs in order while they may run: a suspect only into an empty
        engine, and nothing beside a suspect that runs."""
        while self._waiting:
            job = self._waiting[0]
            if job.ended or job.key not in self._jobs:
                self._waiting.pop(0)
                continue
            if any(self._jobs[key].alone for key in self._running if key in self._jobs):
                return
            if job.alone and (self._running or not self.mark_alone(job)):
                return
            self._waiting.pop(0)
            self._start(job)

    def take(self, outputs: Iterable[RequestOutput]) -> None:
        """A step's outputs into their jobs' outboxes; a job ends with its last sequence."""
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                log.error(
                    "engine output for job %s, which is not held here; dropped", out.request_id
                )
                self._abort_quietly(out.request_id)
                continue
            if job.ended:  # failed alone while the engine still ran it
                self._out_of_engine(job)
                continue
            try:
                if out.error is None:
                    job.add_token(
                        out.token_id,
                        out.text,
                        logprob=out.logprob,
                        top_logprobs=out.top_logprobs,
                        index=out.sample,
                        prompt_logprobs=out.prompt_logprobs,
                        cached_tokens=out.cached_tokens,
                        token_texts=out.token_texts,
                        token_bytes=out.token_bytes,
                        stop_token=out.stop_token,
                    )
                if out.finish_reason is not None:
                    reason = FINISH_REASONS[out.finish_reason]
                    self._sequence_ended(job, out.sample, reason, out.error)
            except Exception as exc:  # one job's failure is that job's alone
                self._out_of_engine(job)
                job.fail("taking its output", exc)

    def cancel(self, job_ids: Iterable[str]) -> None:
        """Cancel the jobs the engine runs among ``job_ids``: abort, final event."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None and self._unwait(job):
                job.end(FinishReason.cancelled)
                continue
            if job is None or job.key not in self._running:
                continue
            self._out_of_engine(job)
            job.end(FinishReason.cancelled)
            log.info("job %s cancelled after %d token(s)", job_id, job.next_seq)

    def settle(self, result: FlushResult) -> list[Job]:
        """Act on a flush's result: finished jobs leave, lost ones are dropped, and ones
        whose stream does not end where they believe are dropped and returned, to be
        picked up again from what the stream holds."""
        for job in result.finished:
            del self._jobs[job.key]
            self.on_finished(job)
        for job in result.lost:
            log.error("job %s: another daemon owns it now; dropped here", job.job_id)
            self._drop(job)
        for job in result.reconcile:
            # Redis lost writes (restart from an older snapshot, failover to a lagging
            # replica) or another daemon wrote: start over from what the stream holds.
            log.warning(
                "job %s: its events stream does not end at seq %d; picked up again from "
                "what Redis holds",
                job.job_id,
                job.stored_events,
            )
            self._drop(job)
        for job in result.gone:
            # Redis lost the job's submit after this daemon read it: the entry is added
            # again from what is held here (Inbox.take_back), and the job runs from it.
            log.warning(
                "job %s: its queue entry %s is gone (Redis lost its submit); dropped here, "
                "enqueued again",
                job.job_id,
                job.delivery.entry_id,
            )
            self._drop(job)
        self.start_waiting()
        return [*result.reconcile, *result.gone]

    def stop_running(self) -> list[Job]:
        """Abort every job the engine still runs (the daemon leaves); they are returned to
        be handed back, their published events the checkpoint."""
        running = [job for job in self._jobs.values() if job.key in self._running]
        for job in running:
            self._out_of_engine(job)
        waiting = [job for job in self._waiting if not job.ended and job.key in self._jobs]
        self._waiting.clear()
        return running + waiting

    # -- sequences ----------------------------------------------------------------------

    def _start(self, job: Job) -> None:
        """Admit each of the job's n sequences, resuming from its own stored tokens."""
        request = job.request
        assert request is not None
        try:
            for sample in range(job.n):
                emitted = tuple(job.sequence(sample).token_ids)
                done = self.gen.start(
                    JobStart(job.job_id, request, job.prompt_token_ids, emitted, sample=sample)
                )
                if done is None:
                    self._running.add(job.key)
                else:
                    self._sequence_ended(job, sample, FINISH_REASONS[done], None)
        except JobRejected as exc:
            self._out_of_engine(job)
            job.reject(exc.reason)
            return
        except Exception as exc:  # one job's failure is that job's alone
            self._running.discard(job.key)
            self._abort_quietly(job.job_id)
            job.fail("admitting it", exc)
            return
        if not job.ended:
            self.on_started(job)
            if job.output_token_ids:
                log.info("job %s resumed at seq %d", job.job_id, job.next_seq)

    def _sequence_ended(
        self, job: Job, sample: int, reason: FinishReason, error: str | None
    ) -> None:
        """One sequence ended: the job ends with the last of its n, or at once on an error
        (its other sequences are dropped). The job's finish reason is sequence 0's."""
        if job.end_sequence(sample, reason):
            self._running.discard(job.key)
        elif reason is FinishReason.error:
            self._out_of_engine(job)
        else:
            return
        final = reason if reason is FinishReason.error else job.sequence(0).finish_reason
        job.end(final or reason, error=error)

    def _drop(self, job: Job) -> None:
        self._out_of_engine(job)
        self._unwait(job)
        del self._jobs[job.key]

    def _unwait(self, job: Job) -> bool:
        """Take ``job`` off the waiting list; True if it was on it."""
        kept = [waiting for waiting in self._waiting if waiting is not job]
        found = len(kept) < len(self._waiting)
        self._waiting = kept
        return found

    def _out_of_engine(self, job: Job) -> None:
        """Abort the job in the engine if it is there (cancelled, lost, handed back)."""
        if job.key in self._running:
            self.gen.abort(job.job_id)
            self._running.discard(job.key)

    def _abort_quietly(self, job_id: str) -> None:
        """Make sure the engine holds nothing of a job that failed half-way in; an engine
        that never had it may refuse the abort."""
        try:
            self.gen.abort(job_id)
        except Exception:
            log.debug("abort of job %s refused by the engine", job_id, exc_info=True)
