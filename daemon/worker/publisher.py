"""Publishing: one pipeline round trip per step writes every job's outbox, in order.

Per job, a fenced append (batchd.daemon.worker.fence) stores its token events (and
PUBLISHes them), then its status fields. A job whose final event and final
status are confirmed stored is finished by the *next* flush: dead letter,
EXPIREs, XACK. So an entry is acked only after a reply said its final event is
stored; a crash between the two leaves a pending job that pickup repairs.

No reply ever drops work: a refused write (OOM, READONLY, NOPERM, ...) keeps
the unsent events and status in the outbox, in order, for the next flush, and
is reported so that the worker backs off. Only a job a later pickup owns
(``lost``) or one whose stream does not end where the job believes
(``reconcile``: Redis lost writes, or another daemon wrote) or whose queue entry
Redis lost (``gone``) leaves the outbox. A held cancelled end (Job.final_held) is not
sent yet: only the events before it.

A flush comes in three parts so that its round trip can overlap the next
engine step: :meth:`Publisher.prepare` builds the pipeline from the outboxes
and remembers exactly what it sends, :meth:`Flush.execute` runs it (on any
thread: it touches no job), and :meth:`Publisher.settle` applies the replies.
Between prepare and settle the step may append to an outbox; settle only ever
removes the events and status fields that this flush sent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import hiredis
import orjson
import redis
from redis.client import Pipeline
from redis.cluster import ClusterPipeline

from batchd.daemon.worker.fence import CREATE_ONLY, Fence, Outcome, Reply
from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.redis_io import load_scripts, pipeline_replies, queue_script
from batchd.producers.keys import CONSUMER_GROUP, EVENT_FIELD, JOB_FIELD, Keys, event_id
from batchd.producers.schema import Event

log = logging.getLogger(__name__)

DEAD_MAXLEN = 10_000
DEAD_PAYLOAD_BYTES = 4096

# Dead-letter a queue entry and ack it, only while it is pending for this consumer: a
# retry after a lost reply (the first attempt ran), or a daemon whose entry another one
# has claimed meanwhile, writes no second letter. Returns XACK's count (0: not ours).
# KEYS: queue stream, dead stream; ARGV: group, entry id, consumer, maxlen, fields...
DEAD_LETTER = """
local mine = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #mine == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
"""


class Piggyback(Protocol):
    """A read that rides along in the step's pipeline (e.g. new cancellations)."""

    def queue(self, pipe: Pipeline) -> int:
        """Add its commands to ``pipe`` (one; on a Redis Cluster one per slot read); how
        many."""
        ...

    def handle(self, results: list[Any]) -> None:
        """The replies of the commands it queued, error replies as values."""
        ...


@dataclass
class FlushResult:
    """What one flush confirmed, and what it could not do."""

    finished: list[Job] = field(default_factory=list)
    lost: list[Job] = field(default_factory=list)
    reconcile: list[Job] = field(default_factory=list)
    gone: list[Job] = field(default_factory=list)  # their queue entry is gone (fence)
    refused: str | None = None
    published_events: int = 0


@dataclass(frozen=True)
class Sent:
    """What one flush sent of a job's outbox: its first events and its status fields."""

    job: Job
    events: list[Event]
    status: dict[str, str]


@dataclass
class Flush:
    """One pipeline built from the outboxes, to execute and then settle."""

    pipe: Pipeline
    writing: list[Sent]
    finishing: list[tuple[Job, int]]  # each job and how many commands finish it
    extras: Sequence[tuple[Piggyback, int]]  # each and how many commands it queued

    def execute(self) -> list[Any]:
        """Run the pipeline: its replies, error replies included as values. Raises redis
        ConnectionError/TimeoutError when Redis is away; which commands ran is then
        unknown, and the next flush's fenced appends find out.

        The commands go out packed by hiredis in one write: redis-py's own pipeline
        spends more Python packing each command, on the CPU the engine computes on. A
        Redis Cluster's pipeline sends each node its commands (redis-py's ClusterPipeline,
        which also follows MOVED and ASK)."""
        if isinstance(self.pipe, ClusterPipeline):
            return pipeline_replies(self.pipe)
        commands = self.pipe.command_stack
        pool = self.pipe.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(
                [b"".join(hiredis.pack_command(tuple(args)) for args, _ in commands)]
            )
            out: list[Any] = []
            for args, options in commands:
                try:
                    out.append(self.pipe.parse_response(connection, args[0], **options))
                except redis.ResponseError as exc:
                    out.append(exc)
        except BaseException:
            connection.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(connection)
        return out


class Publisher:
    """Writes outboxes to Redis; raises redis ConnectionError/TimeoutError when Redis is away
    (the outboxes are then untouched and the next flush sends them again)."""

    def __init__(self, client: redis.Redis, keys: Keys, *, owner: str, result_ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.owner = owner
        self.result_ttl_s = result_ttl_s
        self._dead_letter = client.register_script(DEAD_LETTER)
        self.fence = Fence(client, keys, owner=owner, result_ttl_s=result_ttl_s)
        self._loaded = False
        # Cancelled ends wait until durable (Job.final_held): where a crash loses only the
        # last second (AOF ``everysec``). Decided when the script is loaded (at start, and
        # again after Redis restarted).
        self.hold_ends = True

    def flush(self, jobs: Iterable[Job], extras: Sequence[Piggyback] = ()) -> FlushResult:
        """Send every outbox of ``jobs`` and the ``extras`` in one round trip; what Redis
        confirmed leaves the outboxes, the rest is sent again by the next flush."""
        prepared = self.prepare(jobs, extras)
        if isinstance(prepared, FlushResult):
            return prepared
        return self.settle(prepared, prepared.execute())

    def prepare(self, jobs: Iterable[Job], extras: Sequence[Piggyback] = ()) -> Flush | FlushResult:
        """The pipeline of a flush; or the result of one that sends nothing (nothing to
        write, or Redis refused the append script)."""
        jobs = list(jobs)
        if not self.hold_ends:
            for job in jobs:
                job.release_end()
        outboxes = [(job, *job.outbox()) for job in jobs if job.unpublished or job.status]
        writing = [(job, events, status) for job, events, status in outboxes if events or status]
        finishing = [job for job in jobs if job.stored_final]
        if not writing and not finishing and not extras:
            return FlushResult()
        if not self._loaded:
            try:
                load_scripts(self.redis, self.fence.script, self._dead_letter)
            except redis.ResponseError as exc:  # e.g. NOPERM: keep everything, back off
                return FlushResult(refused=f"loading the append scripts: {exc}")
            self._loaded = True
            self.hold_ends = _loses_acknowledged(self.redis)  # ends released from the next flush
        pipe = self.redis.pipeline(transaction=False)
        sent = []
        for job, events, status in writing:
            try:
                self.fence.queue(pipe, job, events, status)
            except Exception as exc:  # e.g. an event the encoder refuses: this job alone
                job.fail("encoding its events", exc)
                events, status = job.outbox()
                self.fence.queue(pipe, job, events, status)
            sent.append(Sent(job, events, status))
        sizes = [(job, self._queue_finish(pipe, job)) for job in finishing]
        reads = [(extra, extra.queue(pipe)) for extra in extras]
        return Flush(pipe, sent, sizes, reads)

    def settle(self, flush: Flush, replies: list[Any]) -> FlushResult:
        """Apply the replies of ``flush``: confirmed events and status leave the outboxes."""
        result = FlushResult()
        for sent, raw in zip(flush.writing, replies, strict=False):
            self._settle(sent, Reply.parse(raw), result)
        at = len(flush.writing)
        for job, size in flush.finishing:
            self._settle_finish(job, replies[at : at + size], result)
            at += size
        for extra, size in flush.extras:
            extra.handle(replies[at : at + size])
            at += size
        return result

    def _queue_finish(self, pipe: Pipeline, job: Job) -> int:
        """EXPIREs, then dead letter and XACK (or the XACK alone) of a job whose final
        event is stored; how many commands. The ack's reply comes last."""
        size = 0
        if not job.foreign:
            for key in (self.keys.events(job.job_id), self.keys.job(job.job_id)):
                pipe.expire(key, self.result_ttl_s)
            size += 2
        delivery = job.delivery
        queue, entry = self.keys.queue(delivery.queue, delivery.partition), delivery.entry_id
        if job.dead_letter:
            letter: dict[str, str | bytes] = {
                "id": job.job_id,
                "queue": job.delivery.queue,
                "entry": entry,
                "error": job.error or "",
                "payload": _payload_excerpt(job),
            }
            fields = [part for pair in letter.items() for part in pair]
            args: list[str | bytes | int] = [CONSUMER_GROUP, entry, self.owner, DEAD_MAXLEN]
            args += fields
            # The dead stream of the entry's partition: one slot with its queue stream.
            dead = self.keys.dead_stream(delivery.partition)
            queue_script(pipe, self._dead_letter, [queue, dead], args)
        else:
            pipe.xack(queue, CONSUMER_GROUP, entry)
        return size + 1

    def _settle(self, sent: Sent, reply: Reply, out: FlushResult) -> None:
        job = sent.job
        if reply.outcome is Outcome.lost:
            if job.dead_letter and job.epoch == CREATE_ONLY:
                job.leave_untouched()  # the named job appeared since pickup read its keys
            else:
                out.lost.append(job)
            return
        if reply.outcome is Outcome.gone:
            out.gone.append(job)
            return
        if reply.outcome is Outcome.tip:
            self._settle_tip(sent, reply.count, out)
            return
        if not self._confirm(sent, reply.count):
            out.reconcile.append(job)
            return
        out.published_events += reply.count
        if job.epoch == CREATE_ONLY and reply.count > 0:
            job.epoch = 1  # the keys are this append's now: a retry continues them
        if reply.outcome is Outcome.stored:
            for name, value in sent.status.items():
                if job.status.get(name) == value:  # not set again since it was sent
                    del job.status[name]
        else:
            if reply.noscript:
                self._loaded = False
            out.refused = f"job {job.job_id}: {reply.error}"

    def _settle_tip(self, sent: Sent, stored: int, out: FlushResult) -> None:
        """The stream holds ``stored`` events, not what the job believed: this flush's own
        (confirmed), or fewer before a cancelled end (written back: Job.refill); else the
        job is picked up again from what the stream holds."""
        job = sent.job
        if self._confirm_resent(sent, stored):
            return
        lost = job.stored_events - stored
        if job.refill(stored):
            log.warning(
                "job %s: Redis lost %d event(s) before its cancelled end; written back",
                job.job_id,
                lost,
            )
        else:
            out.reconcile.append(job)

    def _settle_finish(self, job: Job, replies: list[Any], out: FlushResult) -> None:
        errors = [reply for reply in replies if isinstance(reply, redis.ResponseError)]
        if job.dead_letter and not isinstance(replies[-1], redis.ResponseError):
            job.dead_letter = False
        if any(isinstance(error, redis.exceptions.NoScriptError) for error in errors):
            self._loaded = False  # the dead letter's script: loaded again by the next flush
        if errors:
            out.refused = f"job {job.job_id}: finishing: {errors[0]}"
            return
        if replies[-1] == 0:
            log.error(
                "job %s: queue entry %s was not pending (acked by an attempt whose reply "
                "was lost, or lost by Redis); job finished",
                job.job_id,
                job.delivery.entry_id,
            )
        out.finished.append(job)

    def _confirm(self, sent: Sent, count: int) -> bool:
        """The first ``count`` events sent are stored: they leave the outbox. False when the
        outbox no longer starts with them (it was rewritten since), which only a fresh
        start from what the stream holds can reconcile."""
        job = sent.job
        stored = sent.events[:count]
        if (
            len(stored) < count
            or len(job.unpublished) < count
            or any(a is not b for a, b in zip(job.unpublished, stored, strict=False))
        ):
            return False
        job.stored(count)
        return True

    def _confirm_resent(self, sent: Sent, stored: int) -> bool:
        """The stream holds more than the job believed: true when the extra events are
        this flush's own (a step whose reply was lost), which are then confirmed."""
        job = sent.job
        extra = stored - job.stored_events
        if extra <= 0 or extra > len(sent.events):
            return False
        entries: Any = self.redis.xrange(
            self.keys.events(job.job_id), event_id(job.stored_events), event_id(stored - 1)
        )
        found = [Event.decode(fields[EVENT_FIELD.encode()]) for _, fields in entries]
        ours = sent.events[:extra]
        if [(e.seq, e.token_id, e.final) for e in found] != [
            (e.seq, e.token_id, e.final) for e in ours
        ]:
            return False
        return self._confirm(sent, extra)


def _loses_acknowledged(client: redis.Redis) -> bool:
    """Whether a crash of this Redis loses a recent second it acknowledged (AOF
    ``everysec`` or ``no``): then a cancelled end waits until durable. Not with
    ``appendfsync always`` (nothing is lost) nor without AOF (everything since the last
    snapshot is: waiting a second saves nothing). Where CONFIG is refused (managed
    Redis, ACLs), assume it does."""
    try:
        config: Any = client.config_get("append*")
    except redis.ResponseError:
        return True
    return bool(config.get("appendonly") == "yes" and config.get("appendfsync") != "always")


def _payload_excerpt(job: Job) -> bytes:
    """The start of the rejected payload (a dead letter never holds 10 MB)."""
    raw = job.delivery.fields.get(JOB_FIELD.encode())
    if raw is None:
        return orjson.dumps(
            {k.decode(errors="replace"): len(v) for k, v in job.delivery.fields.items()}
        )
    return raw[:DEAD_PAYLOAD_BYTES]
