"""Following jobs' events streams: replay, then live, with no gap and no duplicate.

The events stream is the truth (Pub/Sub is at-most-once and redis-py's PubSub
does not resubscribe after a reconnect), so a follower only reads the stream:
non-blocking reads from the next expected seq until it is caught up, then
``XREAD BLOCK`` for what comes next. Entry ids are ``0-<seq+1>``, so "the next
expected seq" is a stream id and a resumed read can neither skip nor repeat an
event. After a dropped connection it backs off and catches up again from the
last seq it delivered.

A job with neither a status hash nor an event for ``missing_timeout_s`` does
not exist (never submitted, or expired): following it raises JobNotFound.

A job can end without a final event (dead-lettered by the daemon, or its
events expired): a follower reads the job's status hash once it has caught
up, and again whenever it has heard nothing for ``status_interval_s``; when
the status says the job is over, it reads the stream once more (the daemon
writes the final event before the status) and, if there is still no final
event, makes one from the status.

On a Redis Cluster one XREAD reaches the keys of one hash slot only, and a
server blocks on its own streams alone: the jobs of several partitions are read
with one non-blocking XREAD per partition, pipelined (:class:`ReadEach`), and
when none had news the follower blocks on one partition at a time, for at most
``SPLIT_BLOCK_MS``, taking the partitions in turn.

The logic is a plan: a generator that yields Redis commands (:class:`Read`,
:class:`ReadEach`, :class:`FetchStatus`, :class:`Pause`) and receives their
replies, or yields a :class:`Delivery`. The sync client, the async client and the bulk runner
drive the same plan, each with its own I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple

import redis

from batchd.producers.errors import JobNotFound, JobTimeout, ProtocolError
from batchd.producers.keys import EVENT_FIELD, Keys, event_id, seq_of
from batchd.producers.schema import Event, FinishReason, JobState, JobStatus

READ_COUNT = 512
# The longest block of a read split by partition on a Cluster: news on another
# partition waits at most this long.
SPLIT_BLOCK_MS = 100
# What a Redis Cluster answers while it changes hands (CLUSTERDOWN while a slot has no
# primary yet, the cluster client's redirections used up, a migrating slot's TRYAGAIN, a
# slot missing from the client's map): waited out like a dropped connection.
CLUSTER_CHANGING = (
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)
# What a dropped or restarting Redis raises, sync and async alike.
RECONNECT_ERRORS = (redis.ConnectionError, redis.TimeoutError, *CLUSTER_CHANGING)
# What a command of a plan can raise that the plan's driver decides about.
COMMAND_ERRORS = (*RECONNECT_ERRORS, redis.ResponseError)


class ReadInterrupted(redis.ConnectionError):
    """A blocking read the server ended with UNBLOCKED: it changed role under the read
    (a failover demoted it). Retried like a dropped connection, not raised to the user."""


def interrupted_read(exc: redis.ResponseError) -> BaseException:
    """``exc`` as a reconnect error when it is an UNBLOCKED reply, else unchanged."""
    return ReadInterrupted(str(exc)) if str(exc).startswith("UNBLOCKED") else exc


_REASON_OF_STATE = {
    JobState.failed: FinishReason.error,
    JobState.cancelled: FinishReason.cancelled,
    JobState.expired: FinishReason.expired,
}


@dataclass(frozen=True)
class Read:
    """XREAD ``streams`` (key -> last id seen); ``block_ms`` None means do not block."""

    streams: dict[Any, Any]
    block_ms: int | None
    count: int = READ_COUNT


@dataclass(frozen=True)
class ReadEach:
    """Several non-blocking :class:`Read` steps in one pipeline; the reply merges them."""

    reads: list[Read]


@dataclass(frozen=True)
class FetchStatus:
    """HGETALL each status hash; the reply is one dict per key, in order."""

    keys: list[str]


@dataclass(frozen=True)
class Pause:
    """Sleep before retrying after a connection error."""

    seconds: float


class Delivery(NamedTuple):
    job_id: str
    event: Event


Step = Read | ReadEach | FetchStatus | Pause | Delivery


class EventCursor:
    """Where one job's stream is read up to; drops duplicates, refuses gaps."""

    def __init__(self, job_id: str, keys: Keys, *, after_seq: int = -1) -> None:
        self.job_id = job_id
        self.events_key = keys.events(job_id)
        self.status_key = keys.job(job_id)
        self.next_seq = after_seq + 1
        self.done = False
        self.quiet_since = -math.inf
        self.status_checked = False
        self.ended: JobStatus | None = None
        # Since when the job has had neither a status hash nor an event (None: it has).
        self.missing_since: float | None = None

    @property
    def last_id(self) -> str:
        return event_id(self.next_seq - 1)

    def accept(self, entries: list[tuple[Any, dict[Any, Any]]]) -> list[Event]:
        """Decode new entries in order; entries already delivered are skipped."""
        events: list[Event] = []
        for entry_id, fields in entries:
            seq = seq_of(entry_id)
            if self.done or seq < self.next_seq:
                continue
            if seq > self.next_seq:
                raise ProtocolError(self.job_id, f"events jump from seq {self.next_seq} to {seq}")
            raw = fields.get(EVENT_FIELD.encode(), fields.get(EVENT_FIELD))
            try:
                event = Event.decode(raw if raw is not None else b"null")
            except ValueError as exc:
                raise ProtocolError(self.job_id, f"undecodable event {seq}: {exc}") from None
            if event.seq != seq:
                raise ProtocolError(self.job_id, f"entry {seq} holds an event with seq {event.seq}")
            self.next_seq += 1
            self.done = event.final
            events.append(event)
        return events

    def final_from_status(self) -> Event:
        """The final event of a job that ended without writing one (see module doc)."""
        assert self.ended is not None
        status = self.ended
        reason = status.finish_reason or _REASON_OF_STATE.get(status.state, FinishReason.error)
        error = status.error
        if status.state is JobState.finished:
            reason, error = FinishReason.error, "the job's events expired before they were read"
        self.done = True
        return Event(seq=self.next_seq, finish_reason=reason, error=error)


class _Outage:
    """Exponential backoff while Redis is unreachable; gives up after ``give_up_s``."""

    def __init__(self, give_up_s: float, max_pause_s: float) -> None:
        self.give_up_s = give_up_s
        self.max_pause_s = max_pause_s
        self.since: float | None = None
        self.attempt = 0

    def failed(self, exc: BaseException) -> float:
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        if now - self.since > self.give_up_s:
            raise exc
        self.attempt += 1
        return float(min(self.max_pause_s, 0.05 * 2 ** (self.attempt - 1)))

    def ok(self) -> None:
        self.since, self.attempt = None, 0


@dataclass(eq=False)
class Follower:
    """Follows the events of a changing set of jobs; drive :meth:`plan` to use it.

    A job leaves the set once its final event is delivered; a consumer may
    :meth:`add` jobs while a delivery is being handled. ``timeout`` (seconds,
    from now) bounds the whole follow and raises JobTimeout. ``cluster``: the reads
    go to a Redis Cluster, so they are split by partition (see the module's doc).
    """

    keys: Keys
    _: KW_ONLY
    cluster: bool = False
    block_ms: int = 1000
    status_interval_s: float = 1.0
    reconnect_timeout_s: float = 60.0
    retry_max_s: float = 2.0
    timeout: float | None = None
    missing_timeout_s: float = 10.0
    deadline: float | None = field(init=False)
    cursors: dict[str, EventCursor] = field(init=False, default_factory=dict)
    # The partition a split read blocks on next (taken in turn).
    _turn: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout

    def add(self, job_id: str, *, after_seq: int = -1) -> None:
        cursor = EventCursor(job_id, self.keys, after_seq=after_seq)
        self.cursors[cursor.events_key] = cursor

    @property
    def active(self) -> int:
        return len(self.cursors)

    def plan(self) -> Generator[Step, Any, None]:
        """The follow loop, free of I/O: yields steps and receives their replies.

        The driver throws a connection error back in at the step that raised it;
        the plan then pauses and catches up from the last delivered seq. Ends when
        every job's final event is delivered; raises JobTimeout, ProtocolError.
        """
        outage = _Outage(self.reconnect_timeout_s, self.retry_max_s)
        catching_up = True
        while self.cursors:
            block_ms = self._block_ms()
            try:
                due = [] if catching_up else self._due()
                if due:
                    hashes = yield FetchStatus([c.status_key for c in due])
                    catching_up = self._note_status(due, hashes)
                    continue
                reply = yield from self._read(None if catching_up else block_ms)
            except RECONNECT_ERRORS as exc:
                catching_up = True
                yield Pause(outage.failed(exc))
                continue
            outage.ok()
            deliveries = self._route(reply)
            if catching_up and not reply:
                deliveries += self._end_from_status()
                catching_up = False
            yield from deliveries

    def _read(self, block_ms: int | None) -> Generator[Step, Any, dict[str, list[Any]]]:
        """Every followed stream from its cursor on: one XREAD, or on a Cluster one per
        partition (blocking, when nothing came, on one partition, briefly)."""
        groups: dict[int, dict[str, str]] = {}
        for key, cursor in self.cursors.items():
            part = self.keys.partition(cursor.job_id) if self.cluster else 0
            groups.setdefault(part, {})[key] = cursor.last_id
        if len(groups) == 1:
            reply: dict[str, list[Any]] = yield Read(next(iter(groups.values())), block_ms)
            return reply
        streams = [groups[part] for part in sorted(groups)]
        reply = yield ReadEach([Read(group, None) for group in streams])
        if reply or block_ms is None:
            return reply
        self._turn = (self._turn + 1) % len(streams)
        reply = yield Read(streams[self._turn], min(block_ms, SPLIT_BLOCK_MS))
        return reply

    def _block_ms(self) -> int:
        if self.deadline is None:
            return self.block_ms
        left = self.deadline - time.monotonic()
        if left <= 0:
            first = next(iter(self.cursors.values()))
            raise JobTimeout(first.job_id, self.timeout or 0.0)
        return max(1, min(self.block_ms, math.ceil(left * 1000)))

    def _due(self) -> list[EventCursor]:
        now = time.monotonic()
        return [
            c
            for c in self.cursors.values()
            if not c.status_checked or now - c.quiet_since >= self.status_interval_s
        ]

    def _note_status(self, due: list[EventCursor], hashes: list[dict[Any, Any]]) -> bool:
        """Remember which jobs have ended; True when the streams must be read again."""
        now = time.monotonic()
        ended = False
        for cursor, data in zip(due, hashes, strict=True):
            cursor.quiet_since = now
            cursor.status_checked = True
            status = _status_or_none(data)
            self._note_missing(cursor, found=bool(data), now=now)
            if status is not None and status.state.terminal:
                cursor.ended = status
                ended = True
        return ended

    def _note_missing(self, cursor: EventCursor, *, found: bool, now: float) -> None:
        """Raise JobNotFound for a job with no status hash for ``missing_timeout_s``: never
        submitted, its submit failed, it expired, or Redis lost it (a crash that dropped
        its last second of writes) after some of its events were delivered: waiting for
        the rest would wait forever. (A follower may start just before the submit, or
        before a daemon picks up a bare XADD entry: hence the wait.)"""
        if found:
            cursor.missing_since = None
        elif cursor.missing_since is None:
            cursor.missing_since = now
        elif now - cursor.missing_since >= self.missing_timeout_s:
            raise JobNotFound(cursor.job_id)

    def _route(self, reply: dict[str, list[Any]]) -> list[Delivery]:
        now = time.monotonic()
        deliveries: list[Delivery] = []
        for key, entries in reply.items():
            cursor = self.cursors.get(key)
            if cursor is None:
                continue
            cursor.quiet_since = now
            deliveries += [Delivery(cursor.job_id, e) for e in cursor.accept(entries)]
            if cursor.done:
                del self.cursors[key]
        return deliveries

    def _end_from_status(self) -> list[Delivery]:
        ended = [c for c in self.cursors.values() if c.ended is not None]
        for cursor in ended:
            del self.cursors[cursor.events_key]
        return [Delivery(c.job_id, c.final_from_status()) for c in ended]


class PlanDriver:
    """Hands a plan the outcome of each command it asked for. The I/O stays with the
    caller (blocking or asyncio), so stepping a plan is written once."""

    def __init__(self, plan: Generator[Step, Any, None]) -> None:
        self._plan = plan
        self._step: Step | None = None
        self._reply: Any = None
        self._error: BaseException | None = None

    def next_step(self) -> Step | None:
        """The plan's next step, given the last command's outcome; None once it ended."""
        reply, error = self._reply, self._error
        self._reply, self._error = None, None
        try:
            self._step = self._plan.throw(error) if error is not None else self._plan.send(reply)
        except StopIteration:
            self._step = None
        return self._step

    def answered(self, reply: Any) -> None:
        if isinstance(self._step, Read):
            reply = read_reply(reply)
        elif isinstance(self._step, ReadEach):
            reply = {key: entries for one in reply for key, entries in read_reply(one).items()}
        self._reply = reply

    def failed(self, error: BaseException) -> None:
        """One of COMMAND_ERRORS: a reconnect error (an UNBLOCKED read among them) makes
        the plan pause and catch up from the last seq; any other is raised."""
        if isinstance(error, redis.ResponseError) and isinstance(self._step, Read | ReadEach):
            error = interrupted_read(error)
        if not isinstance(error, RECONNECT_ERRORS):
            raise error
        self._error = error


def issue(connection: Any, step: Read | ReadEach | FetchStatus) -> Any:
    """Send ``step``'s command on a redis-py connection, blocking or asyncio: the reply,
    or an awaitable of it (both clients have the same method names)."""
    if isinstance(step, Read):
        return connection.xread(step.streams, count=step.count, block=step.block_ms)
    pipe = connection.pipeline(transaction=False)
    if isinstance(step, ReadEach):
        for read in step.reads:
            pipe.xread(read.streams, count=read.count)
    else:
        for key in step.keys:
            pipe.hgetall(key)
    return pipe.execute()


def _status_or_none(data: dict[Any, Any]) -> JobStatus | None:
    try:
        return JobStatus.from_hash(data) if data else None
    except ValueError:  # a hash without a valid state tells nothing yet
        return None


def read_reply(raw: Any) -> dict[str, list[Any]]:
    """XREAD's reply as {stream key: entries}: RESP2 gives [[key, entries]], RESP3
    gives {key: [entries]}."""
    if not raw:
        return {}
    if isinstance(raw, dict):
        pairs = [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in raw.items()]
    else:
        pairs = [(k, v) for k, v in raw]
    return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in pairs}
