"""Poison means this job: a crash is blamed on a job only when the job ran alone.

A daemon that dies mid-batch takes every job of the batch with it: counting
deliveries blames the innocent (six kills of a busy daemon make every long job
"poison"). So a job delivered more than :func:`suspect_after` times (two crashes
with it in the batch) becomes a *suspect*: the daemon runs it by itself, nothing
else in the engine (batchd.daemon.worker.held). Before it starts alone, its status
hash records where (``alone_delivery``: its delivery count, ``alone_from``: the
events stored). A later pickup that finds that mark from an earlier delivery and
no event added since knows the daemon died while the job ran alone without
progress: one crash counts against the job (``alone_crashes``). At
:data:`POISON_ALONE_CRASHES` it is dead-lettered, and the reason says so. A job
killed alone by something else (an operator's ``kill -9``, a host crash) after
making progress is not counted.
"""

from __future__ import annotations

import logging

import redis

from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.member import Member
from batchd.daemon.worker.redis_io import REDIS_DOWN

log = logging.getLogger(__name__)

# Crashes while running alone, with no progress, that make a job poison. Two, not one:
# a kill from outside in the moment before an alone job's first event is not its fault.
POISON_ALONE_CRASHES = 2
# Crashes with a job in the batch after which it runs alone (fewer if max_deliveries is
# lower: a job delivered more than max_deliveries times always runs alone).
SUSPECT_AFTER_CRASHES = 2

_DELIVERY, _FROM, _CRASHES = "alone_delivery", "alone_from", "alone_crashes"


def suspect_after(max_deliveries: int) -> int:
    """Deliveries after which a job runs alone."""
    return min(max_deliveries, SUSPECT_AFTER_CRASHES)


def alone_crashes(raw_status: dict[bytes, bytes], *, deliveries: int, stored_events: int) -> int:
    """Crashes counted against a job at this pickup: those counted before, plus one if an
    earlier delivery started it alone and its events stream has not grown since."""
    try:
        crashes = int(raw_status.get(_CRASHES.encode(), b"0"))
        at = raw_status.get(_DELIVERY.encode())
        if at is not None and int(at) < deliveries:
            if int(raw_status.get(_FROM.encode(), b"-1")) == stored_events:
                crashes += 1
    except ValueError:
        return 0
    return crashes


def note_counted(member: Member, job: Job) -> None:
    """Store a crash just counted and clear the mark, so a later pickup never counts the
    same crash again (e.g. after a daemon died while the job waited for its turn)."""
    key = member.keys.job(job.job_id)
    pipe = member.redis.pipeline(transaction=True)
    pipe.hset(key, _CRASHES, str(job.alone_crashes))
    pipe.hdel(key, _DELIVERY, _FROM)
    try:
        pipe.execute()
    except (*REDIS_DOWN, redis.ResponseError) as exc:
        # Only a later pickup may count this crash once more: never a job's own failure.
        log.warning("job %s: crash while alone not stored (%s)", job.job_id, exc)
    log.warning(
        "job %s: the daemon died while it ran alone with no progress (%d time(s))",
        job.job_id,
        job.alone_crashes,
    )


def mark_alone(member: Member, job: Job) -> bool:
    """Record on the job's status hash that it starts alone now; False (start it later)
    when Redis did not take the write."""
    try:
        member.redis.hset(
            member.keys.job(job.job_id),
            mapping={
                _DELIVERY: str(job.delivery.deliveries),
                _FROM: str(job.stored_events),
                _CRASHES: str(job.alone_crashes),
            },
        )
    except (*REDIS_DOWN, redis.ResponseError) as exc:
        log.warning("job %s: cannot mark it running alone (%s); starts later", job.job_id, exc)
        return False
    log.warning(
        "job %s: delivered %d times; runs alone (%d crash(es) while alone so far)",
        job.job_id,
        job.delivery.deliveries,
        job.alone_crashes,
    )
    return True
