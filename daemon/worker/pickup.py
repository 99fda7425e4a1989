"""Pickup: decide what each delivered queue entry becomes, in one Redis round trip.

A delivery is parsed and validated (protocol limits, then token limits after
tokenizing); its status hash and events stream say whether it is new, a job
to resume at the next seq, one already finished that only needs its status
and ack repaired, a duplicate of a job seen before, cancelled, expired, a
suspect to run alone, or poison (batchd.daemon.fleet.poison). Bad input never
raises out of here: it becomes a failed job with a final error event and a dead
letter.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import orjson
import redis

from batchd.config.limits import LimitSettings
from batchd.daemon.fleet.poison import (
    POISON_ALONE_CRASHES,
    alone_crashes,
    note_counted,
    suspect_after,
)
from batchd.daemon.worker.fence import CREATE_ONLY
from batchd.daemon.worker.generator import JobRejected
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.redis_io import pipeline_replies
from batchd.producers.errors import ValidationError
from batchd.producers.keys import ENTRY_FIELD, EVENT_FIELD, JOB_FIELD, is_name
from batchd.producers.schema import (
    Event,
    FinishReason,
    JobRequest,
    JobState,
    JobStatus,
    job_seed,
    parse_job,
)

log = logging.getLogger(__name__)

_ID_FIELD = re.compile(r'"id"\s*:\s*"([^"\\]{1,128})"')

Encode = Callable[[str, JobRequest], list[int]]


@dataclass
class Pickup:
    """The outcome for a batch of deliveries."""

    run: list[Job] = field(default_factory=list)
    ended: list[Job] = field(default_factory=list)
    acks: list[Delivery] = field(default_factory=list)


@dataclass(eq=False)
class PickupPolicy:
    """Turns deliveries into jobs to run, jobs to end at once, and entries to just ack."""

    member: Member
    _: KW_ONLY
    limits: LimitSettings
    max_deliveries: int
    encode: Encode

    def pick_up(self, deliveries: list[Delivery]) -> Pickup:
        out = Pickup()
        if not deliveries:
            return out
        jobs = [_parse_alone(delivery, self.limits) for delivery in deliveries]
        pipe = self.member.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.hgetall(self.member.keys.job(job.job_id))
            pipe.xrange(self.member.keys.events(job.job_id))
        keys = pipeline_replies(pipe)
        for i, job in enumerate(jobs):
            try:
                self._decide(job, keys[2 * i], keys[2 * i + 1], out)
            except Exception as exc:  # one job's failure is that job's alone
                job.fail("picking it up", exc)
                if job not in out.ended:
                    out.ended.append(job)
                if job in out.run:
                    out.run.remove(job)
        return out

    def _decide(self, job: Job, raw_status: Any, raw_events: Any, out: Pickup) -> None:
        for reply in (raw_status, raw_events):
            if isinstance(reply, redis.ResponseError):
                # Its keys cannot be written either (e.g. WRONGTYPE): ack, never retry forever.
                log.error("job %s: cannot read its keys (%s); acked, not run", job.job_id, reply)
                out.acks.append(job.delivery)
                return
        if self._misfiled(job):
            out.ended.append(job)
            return
        if job.request is None:  # rejected by _parse: it owns no job
            if raw_status or raw_events:
                job.leave_untouched()
            else:
                job.epoch = CREATE_ONLY
            out.ended.append(job)
            return
        # This pickup's epoch fences off every earlier holder of the job (worker.fence).
        job.epoch = int(raw_status.get(b"epoch", b"0")) + 1
        job.stored_events = len(raw_events)
        if self._taken(job, raw_status, out):
            return
        job.alone_crashes = alone_crashes(
            raw_status, deliveries=job.delivery.deliveries, stored_events=job.stored_events
        )
        if job.alone_crashes > alone_crashes(raw_status, deliveries=0, stored_events=0):
            note_counted(self.member, job)
        status = _status(job.job_id, raw_status)
        try:
            events = [Event.decode(fields[EVENT_FIELD.encode()]) for _, fields in raw_events]
        except (ValueError, KeyError) as exc:
            job.reject(f"events stream unreadable: {exc}")
            _no_final_event(job)
            out.ended.append(job)
            return
        if events and events[-1].final:
            _repair(job, events[-1])
            out.ended.append(job)
            return
        if status is not None and status.state.terminal:
            log.info("job %s is already %s; acked, not run", job.job_id, status.state.value)
            out.acks.append(job.delivery)
            return
        self._start(job, status, events, out)

    def _misfiled(self, job: Job) -> bool:
        """True (the entry to be dead-lettered only) when the entry is in a partition of
        its queue other than its job id's: a raw producer's mistake, or an entry with no
        id in a partitioned queue (its entry id then names the job)."""
        keys, delivery = self.member.keys, job.delivery
        if keys.partition(job.job_id) == delivery.partition:
            return False
        job.misfiled(
            f"job {job.job_id!r} belongs to partition {keys.partition(job.job_id)} of queue "
            f"{delivery.queue!r} but was added to partition {delivery.partition} "
            f"({keys.queue(delivery.queue, delivery.partition)}): add a job to the stream "
            f"its id names, {keys.queue_for(delivery.queue, job.job_id)} (the job's id is "
            "required on a partitioned queue)"
        )
        return True

    def _taken(self, job: Job, raw_status: dict[bytes, bytes], out: Pickup) -> bool:
        """True (and the entry acked) when another entry already took this job id."""
        stored_entry = raw_status.get(ENTRY_FIELD.encode())
        if stored_entry is not None and stored_entry.decode() != job.delivery.entry_id:
            log.warning(
                "job %s: entry %s repeats a job id already taken by entry %s; not run twice",
                job.job_id,
                job.delivery.entry_id,
                stored_entry.decode(),
            )
            out.acks.append(job.delivery)
            return True
        return False

    def _start(self, job: Job, status: JobStatus | None, events: list[Event], out: Pickup) -> None:
        """Resume from the stored events; end early, refuse, or hand over to run."""
        try:
            job.resume_from(events)
        except ValueError as exc:
            job.reject(str(exc))
            _no_final_event(job)
            out.ended.append(job)
            return
        self._start_timings(job, status)
        if self._ended_early(job, status, started=bool(events)):
            out.ended.append(job)
            return
        assert job.request is not None
        try:
            job.prompt_token_ids = self.encode(job.job_id, job.request)
        except JobRejected as exc:
            job.reject(exc.reason)
            out.ended.append(job)
            return
        if len(job.prompt_token_ids) > self.limits.max_prompt_tokens:
            job.reject(
                f"prompt: {len(job.prompt_token_ids)} tokens exceed the limit "
                f"{self.limits.max_prompt_tokens}",
            )
            out.ended.append(job)
            return
        out.run.append(job)

    def _ended_early(self, job: Job, status: JobStatus | None, *, started: bool) -> bool:
        """Cancelled before (re)start, expired before start, or poison: end without running."""
        request = job.request
        assert request is not None
        deliveries = job.delivery.deliveries
        if status is not None and status.cancel_requested:
            job.end(FinishReason.cancelled)
        elif (
            not started
            and request.ttl_s is not None
            and time.time() - job.delivery.enqueued_at > request.ttl_s
        ):
            job.end(FinishReason.expired, error=f"not started within ttl_s={request.ttl_s:g}")
        elif job.alone_crashes >= POISON_ALONE_CRASHES:
            job.reject(
                f"poison: the daemon died {job.alone_crashes} times while running this job "
                f"alone, with no progress (delivered {deliveries} times)"
            )
        else:
            # Two crashes with it in the batch: it runs by itself from now on (fleet.poison).
            job.alone = deliveries > suspect_after(self.max_deliveries)
            return False
        return True

    def _start_timings(self, job: Job, status: JobStatus | None) -> None:
        now = time.time()
        job.timings.queued = (status.queued_at if status else None) or job.delivery.enqueued_at
        job.timings.started = (status.started_at if status else None) or now
        job.timings.first_token = status.first_token_at if status else None
        job.set_status(
            state=JobState.running,
            queue=job.delivery.queue,
            daemon=self.member.consumer,
            entry=job.delivery.entry_id,
            queued_at=job.timings.queued,
            started_at=job.timings.started,
        )


def _parse_alone(delivery: Delivery, limits: LimitSettings) -> Job:
    """:func:`_parse`, where even an unexpected error rejects this entry only."""
    try:
        return _parse(delivery, limits)
    except Exception as exc:
        job = Job(job_id=delivery.entry_id, delivery=delivery)
        log.exception("entry %s: unexpected error while parsing it", delivery.entry_id)
        job.reject(f"job: cannot be parsed: {type(exc).__name__}: {exc}")
        return job


def _parse(delivery: Delivery, limits: LimitSettings) -> Job:
    """A Job with its request, or an ended failed Job naming what is wrong."""
    payload = delivery.fields.get(JOB_FIELD.encode())
    job_id = _recover_id(payload, limits.max_message_bytes) or delivery.entry_id
    job = Job(job_id=job_id, delivery=delivery)
    if payload is None:
        fields = sorted(k.decode(errors="replace") for k in delivery.fields)
        job.reject(f"job: missing field {JOB_FIELD!r} (entry has {fields})")
        return job
    try:
        request = parse_job(payload, limits)
    except ValidationError as exc:
        job.reject(str(exc))
        return job
    except Exception as exc:
        # A parser bug: the job still fails under its own id, so its client hears of it.
        log.exception("entry %s: unexpected error while parsing it", delivery.entry_id)
        job.reject(f"job: cannot be parsed: {type(exc).__name__}: {exc}")
        return job
    job.request = request
    if request.id is None:
        # A raw producer that sent no id: the entry id names the job.
        job.request = request.model_copy(update={"id": job_id})
    if request.seed is None:
        # Every job samples as if seeded (raw producers too): a resume or a re-run after
        # Redis lost a tail draws the same tokens, so followers only ever read one run.
        job.request = job.request.model_copy(update={"seed": job_seed(job_id)})
    return job


def _recover_id(payload: bytes | None, max_bytes: int) -> str | None:
    """The job id of a payload that may be broken (bad bytes, cut JSON, too large), if it
    names one. A payload over ``max_bytes`` is never parsed: only its start is searched."""
    if payload is None:
        return None
    if len(payload) <= max_bytes:
        try:
            data = orjson.loads(payload.decode("utf-8", errors="replace"))
        except orjson.JSONDecodeError:
            pass
        else:
            # Parsed: only a top-level id counts (never one inside e.g. metadata).
            value = data.get("id") if isinstance(data, dict) else None
            return value if is_name(value) else None
    found = _ID_FIELD.search(payload[:4096].decode("utf-8", errors="replace"))
    return found.group(1) if found and is_name(found.group(1)) else None


def _status(job_id: str, raw: dict[bytes, bytes]) -> JobStatus | None:
    if not raw:
        return None
    try:
        return JobStatus.from_hash(raw)
    except ValueError as exc:
        log.warning("job %s: unreadable status hash (%s); treated as new", job_id, exc)
        return None


def _no_final_event(job: Job) -> None:
    """A failed job whose events stream cannot take its final event (unreadable, or
    not this job's): only its status is written, then it is acked."""
    job.unpublished.clear()


def _repair(job: Job, final: Event) -> None:
    """The final event is stored: write its status (idempotent) and ack; nothing runs."""
    reason = final.finish_reason
    assert reason is not None
    job.finish_reason = reason
    job.set_final_status(
        reason,
        finished_at=final.timings.finished if final.timings else None,
        completion_tokens=final.usage.completion_tokens if final.usage else None,
        error=final.error,
    )
    log.info("job %s: final event found; status and ack repaired", job.job_id)
