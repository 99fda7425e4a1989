"""Publishing: one pipeline round trip per step writes every job's outbox, in order.

Per job, the commands are ordered token events (XADD with the explicit id
``0-<seq+1>`` then PUBLISH), status fields, and for an ended job: final event,
final status, EXPIREs, dead letter, XACK. Each command is idempotent or
guarded, so a pipeline resent after a connection drop, or a crash between any
two commands, leaves nothing that recovery cannot repair: an XADD whose id is
already taken fails (the exactly-once guard) without failing the pipeline.
Such a duplicate is checked against the stored event: our own earlier write
is fine; anything else means another daemon owns the job now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
import redis
from redis.client import Pipeline

from daemon.worker import crashpoint
from daemon.worker.jobs import Job
from producers.keys import CONSUMER_GROUP, EVENT_FIELD, JOB_FIELD, Keys, event_id, seq_of
from producers.schema import Event

log = logging.getLogger(__name__)

DEAD_MAXLEN = 10_000
DEAD_PAYLOAD_BYTES = 4096


class Piggyback(Protocol):
    """A read that rides along in the step's pipeline (e.g. new cancellations)."""

    def queue(self, pipe: Pipeline) -> None:
        """Add exactly one command to ``pipe``."""
        ...

    def handle(self, result: Any) -> None: ...


@dataclass
class FlushResult:
    """What one flush confirmed: jobs fully finished (acked) and jobs lost to another owner."""

    finished: list[Job] = field(default_factory=list)
    lost: list[Job] = field(default_factory=list)
    published_events: int = 0


@dataclass
class _Plan:
    """Which job (and which event, if an XADD) each pipeline command belongs to."""

    owners: list[tuple[Job, Event | None]] = field(default_factory=list)

    def add(self, job: Job, event: Event | None = None) -> None:
        self.owners.append((job, event))


class Publisher:
    """Writes outboxes to Redis; raises redis ConnectionError/TimeoutError when Redis is away
    (the outboxes are then untouched and the next flush sends them again)."""

    def __init__(self, client: redis.Redis, keys: Keys, *, result_ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.result_ttl_s = result_ttl_s

    def flush(self, jobs: Iterable[Job], extras: Sequence[Piggyback] = ()) -> FlushResult:
        """Send every outbox of ``jobs`` and the ``extras`` in one round trip; outboxes
        Redis confirmed are cleared, the others are sent again by the next flush."""
        pending = [job for job in jobs if job.unpublished or job.status or job.ended]
        result = FlushResult()
        if not pending and not extras:
            return result
        phases = self._phases(pending)
        # Crash tests kill the daemon between two phases of a finish: only then is the
        # pipeline sent phase by phase.
        split = any(job.ended for job in pending) and (
            crashpoint.armed("after_final_event") or crashpoint.armed("after_status")
        )
        replies: list[Any] = []
        plan = _Plan()
        pipe = self.redis.pipeline(transaction=False)
        for name, build in phases:
            build(pipe, plan)
            if split:
                replies += pipe.execute(raise_on_error=False)
                crashpoint.reached(name)
        for extra in extras:
            extra.queue(pipe)
        replies += pipe.execute(raise_on_error=False)
        extra_replies = replies[len(plan.owners) :]
        for extra, reply in zip(extras, extra_replies, strict=True):
            extra.handle(reply)
        self._settle(pending, plan, replies[: len(plan.owners)], result)
        return result

    def _phases(self, jobs: list[Job]) -> list[tuple[str, Callable[[Pipeline, _Plan], None]]]:
        def events(pipe: Pipeline, plan: _Plan) -> None:
            for job in jobs:
                for event in job.unpublished:
                    payload = event.encode()
                    pipe.xadd(
                        self.keys.events(job.job_id), {EVENT_FIELD: payload}, id=event_id(event.seq)
                    )
                    plan.add(job, event)
                    pipe.publish(self.keys.tokens(job.job_id), payload)
                    plan.add(job)

        def status(pipe: Pipeline, plan: _Plan) -> None:
            for job in jobs:
                if job.status:
                    fields: dict[Any, Any] = dict(job.status)
                    pipe.hset(self.keys.job(job.job_id), mapping=fields)
                    plan.add(job)

        def finish(pipe: Pipeline, plan: _Plan) -> None:
            for job in jobs:
                if job.ended:
                    self._queue_finish(pipe, plan, job)

        return [("after_final_event", events), ("after_status", status), ("finished", finish)]

    def _queue_finish(self, pipe: Pipeline, plan: _Plan, job: Job) -> None:
        for key in (self.keys.events(job.job_id), self.keys.job(job.job_id)):
            pipe.expire(key, self.result_ttl_s)
            plan.add(job)
        if job.dead_letter:
            pipe.xadd(
                self.keys.dead,
                {
                    "id": job.job_id,
                    "queue": job.delivery.queue,
                    "entry": job.delivery.entry_id,
                    "error": job.error or "",
                    "payload": _payload_excerpt(job),
                },
                maxlen=DEAD_MAXLEN,
                approximate=True,
            )
            plan.add(job)
        pipe.xack(self.keys.queue(job.delivery.queue), CONSUMER_GROUP, job.delivery.entry_id)
        plan.add(job)

    def _settle(self, jobs: list[Job], plan: _Plan, replies: list[Any], out: FlushResult) -> None:
        duplicates: dict[str, list[Event]] = {}
        for (job, event), reply in zip(plan.owners, replies, strict=True):
            if isinstance(reply, redis.ResponseError):
                # XADD's refusal of an id not above the stream's last one (see module doc).
                if event is not None and "equal or smaller" in str(reply):
                    duplicates.setdefault(job.job_id, []).append(event)
                else:
                    log.error("job %s: redis refused a publish command: %s", job.job_id, reply)
            elif event is not None:
                out.published_events += 1
        for job in jobs:
            if job.job_id in duplicates and not self._own_writes(job, duplicates[job.job_id]):
                out.lost.append(job)
                continue
            job.unpublished.clear()
            job.status.clear()
            if job.ended:
                out.finished.append(job)

    def _own_writes(self, job: Job, events: list[Event]) -> bool:
        """True when the stored events at these seqs are ours (a resent pipeline)."""
        first = min(event.seq for event in events)
        entries: Any = self.redis.xrange(self.keys.events(job.job_id), event_id(first))
        stored = {
            seq_of(entry_id): Event.decode(fields[EVENT_FIELD.encode()])
            for entry_id, fields in entries
        }
        last_ours = max(event.seq for event in job.unpublished)
        if any(seq > last_ours for seq in stored):
            log.warning(
                "job %s: events past seq %d stored by another daemon", job.job_id, last_ours
            )
            return False
        for event in events:
            found = stored.get(event.seq)
            if found is None or (found.token_id, found.final) != (event.token_id, event.final):
                log.warning("job %s: seq %d stored by another daemon", job.job_id, event.seq)
                return False
        return True


def _payload_excerpt(job: Job) -> bytes:
    """The start of the rejected payload (a dead letter never holds 10 MB)."""
    raw = job.delivery.fields.get(JOB_FIELD.encode())
    if raw is None:
        return orjson.dumps(
            {k.decode(errors="replace"): len(v) for k, v in job.delivery.fields.items()}
        )
    return raw[:DEAD_PAYLOAD_BYTES]
