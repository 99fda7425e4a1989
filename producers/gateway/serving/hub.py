"""One reader for the events streams of every job a gateway answers.

A job followed on its own holds a Redis connection for its whole life (its ``XREAD
BLOCK``): a thousand open streams would need a thousand connections. The hub follows
them all with one: a single ``XREAD BLOCK`` names every followed job's stream (from the
next seq each expects, so nothing is skipped or repeated: :class:`EventCursor`) plus the
hub's own wake stream, on which a new subscription ``XADD``\\s so that the blocked read
returns and starts following it at once.

It keeps the follower's promises (:mod:`batchd.producers.follow`): a job whose status
says it ended without a final event gets one made from its status, a job with neither a
status nor an event for ``missing_timeout_s`` fails with JobNotFound, and a lost
connection is retried (backing off to ``retry_max_s``) and caught up from the last seq;
only an outage longer than ``outage_timeout_s`` fails the jobs followed. A failure that
belongs to one job (a gap in its stream) fails that job alone.

On a Redis Cluster one XREAD reaches the keys of one hash slot, so the hub keeps a
:class:`Lane` per partition, each with its own blocked read and wake stream (in the
partition's slot): a token reaches its request as soon as on a single Redis, for one
blocked connection per partition. Elsewhere one lane follows every job, as above. The
key layout is read once, on the first subscription.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
import redis.asyncio as aioredis

from batchd.producers.connection import is_cluster
from batchd.producers.errors import JobNotFound, ProtocolError
from batchd.producers.follow import RECONNECT_ERRORS, EventCursor, read_reply
from batchd.producers.gateway.fleet import KeysSource, keys_from
from batchd.producers.keys import Keys
from batchd.producers.schema import Event, JobStatus

log = logging.getLogger(__name__)

READ_COUNT = 512
WAKE_MAXLEN = 16
WAKE_TTL_MS = 60_000
OUTAGE_ERRORS = RECONNECT_ERRORS


class Subscription:
    """One followed job: its events, in order, ending with the final one."""

    def __init__(self, job_id: str, keys: Keys) -> None:
        self.cursor = EventCursor(job_id, keys)
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.closed = False

    @property
    def job_id(self) -> str:
        return self.cursor.job_id

    async def get(self, timeout: float | None = None) -> Event | None:
        """The next event; None when ``timeout`` seconds pass first. Raises what ended
        the follow (JobNotFound, ProtocolError, a Redis error after a long outage)."""
        try:
            if timeout is None:
                item = await self._queue.get()
            else:
                item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def events(self) -> AsyncIterator[Event]:
        """Every event up to and including the final one."""
        while True:
            event = await self.get()
            assert event is not None
            yield event
            if event.final:
                return

    def deliver(self, item: Event | BaseException) -> None:
        self._queue.put_nowait(item)


class Lane:
    """The jobs one blocking XREAD follows, with the wake stream that ends it early."""

    def __init__(self, wake_key: str) -> None:
        self.wake_key = wake_key
        self.wake_id = "0-0"
        self.subs: dict[str, Subscription] = {}
        self.added = asyncio.Event()
        self.blocked = False
        self.woken = False
        self.outage_since: float | None = None


class Hub:
    """Follows jobs for many requests over ``conn`` (a client of its own: it blocks; on a
    Cluster the connection factory's, which reads the slots again after a node is lost:
    :mod:`batchd.producers.connection.factory`); wakes go through ``pooled``. Run
    :meth:`run` as a task while the gateway serves.
    ``layout``: the key names, or a coroutine function giving them (called once)."""

    def __init__(
        self,
        conn: aioredis.Redis,
        pooled: aioredis.Redis,
        layout: KeysSource,
        *,
        block_ms: int = 1000,
        status_interval_s: float = 1.0,
        missing_timeout_s: float = 10.0,
        outage_timeout_s: float = 60.0,
        retry_max_s: float = 0.25,
    ) -> None:
        self.conn = conn
        self.pooled = pooled
        self._layout = layout
        self.keys: Keys | None = None
        self.block_ms = block_ms
        self.status_interval_s = status_interval_s
        self.missing_timeout_s = missing_timeout_s
        self.outage_timeout_s = outage_timeout_s
        self.retry_max_s = retry_max_s
        self._token = secrets.token_hex(8)
        self._lanes: list[Lane] = []
        self._ready = asyncio.Event()
        self._stopping = False

    @property
    def followed(self) -> int:
        return sum(len(lane.subs) for lane in self._lanes)

    @property
    def outage_since(self) -> float | None:
        """Since when a lane's reads have been failing (None: none is)."""
        since = [lane.outage_since for lane in self._lanes if lane.outage_since is not None]
        return min(since, default=None)

    async def _lane_of(self, job_id: str) -> tuple[Keys, Lane]:
        """The key names (read on first use) and the lane following ``job_id``."""
        if self.keys is None:
            self.keys = await keys_from(self._layout)
        keys = self.keys
        if not self._lanes:
            partitions: list[int | None] = [None]  # one lane, untagged
            if is_cluster(self.conn):  # a lane per partition, in its hash slot
                partitions = [*range(keys.partitions)]
            self._lanes = [Lane(keys.gateway_wake(self._token, k)) for k in partitions]
            self._ready.set()
        lane = self._lanes[keys.partition(job_id) if len(self._lanes) > 1 else 0]
        return keys, lane

    @asynccontextmanager
    async def subscribe(self, job_id: str) -> AsyncIterator[Subscription]:
        """Follow ``job_id`` for the duration of the block."""
        keys, lane = await self._lane_of(job_id)
        sub = Subscription(job_id, keys)
        key = sub.cursor.events_key
        lane.subs[key] = sub
        lane.added.set()
        try:
            await self._wake(lane)
            yield sub
        finally:
            sub.closed = True
            if lane.subs.get(key) is sub:
                del lane.subs[key]

    async def _wake(self, lane: Lane) -> None:
        """End the lane's blocked read so that it names the new stream (one wake per
        read; a read cannot be cancelled midway: redis-py waits it out)."""
        if not lane.blocked or lane.woken:
            return
        lane.woken = True
        try:
            pipe = self.pooled.pipeline(transaction=False)
            pipe.xadd(lane.wake_key, {"w": b"1"}, maxlen=WAKE_MAXLEN, approximate=True)
            pipe.pexpire(lane.wake_key, WAKE_TTL_MS)
            await pipe.execute()
        except OUTAGE_ERRORS:  # the read ends by itself within block_ms
            lane.woken = False

    async def wake_all(self) -> None:
        """End every lane's read in flight (at a stop)."""
        for lane in self._lanes:
            await self._wake(lane)

    def stop(self) -> None:
        """Make :meth:`run` return (also when a cancelled read ends in an error)."""
        self._stopping = True

    async def run(self) -> None:
        """Read for every subscription until :meth:`stop` (or cancelled)."""
        await self._ready.wait()
        await asyncio.gather(*(self._follow(lane) for lane in self._lanes))

    async def _follow(self, lane: Lane) -> None:
        """One lane's reads until :meth:`stop`."""
        attempt = 0
        while not self._stopping:
            if not lane.subs:
                lane.added.clear()
                await lane.added.wait()
                continue
            try:
                await self._check_status(lane)
                await self._read(lane)
            except OUTAGE_ERRORS as exc:
                if self._stopping:  # a cancelled read can end as a timeout
                    return
                attempt += 1
                await asyncio.sleep(self._outage(lane, exc, attempt))
                continue
            except redis.ResponseError as exc:
                attempt += 1
                if str(exc).startswith("UNBLOCKED"):  # a failover ended the read
                    await asyncio.sleep(self._outage(lane, exc, attempt))
                else:
                    self._fail_all(lane, exc)
                    await asyncio.sleep(self.retry_max_s)
                continue
            except Exception as exc:  # a bug: fail the requests, keep serving
                log.exception("events read failed")
                self._fail_all(lane, exc)
                await asyncio.sleep(self.retry_max_s)
                continue
            if lane.outage_since is not None:
                log.info("events reads resumed after %.1f s", time.monotonic() - lane.outage_since)
            lane.outage_since, attempt = None, 0

    def _outage(self, lane: Lane, exc: BaseException, attempt: int) -> float:
        """Note a failed read; the pause before the next. Past ``outage_timeout_s`` every
        job the lane follows fails with ``exc``."""
        now = time.monotonic()
        if lane.outage_since is None:
            lane.outage_since = now
            log.warning("events reads failing: %s: %s", type(exc).__name__, exc)
        elif now - lane.outage_since > self.outage_timeout_s:
            self._fail_all(lane, exc)
        return float(min(self.retry_max_s, 0.02 * 2 ** (attempt - 1)))

    async def _read(self, lane: Lane) -> None:
        streams: dict[Any, Any] = {lane.wake_key: lane.wake_id}
        streams.update({key: sub.cursor.last_id for key, sub in lane.subs.items()})
        lane.blocked, lane.woken = True, False
        try:
            raw = await self.conn.xread(streams, count=READ_COUNT, block=self.block_ms)
        finally:
            lane.blocked = False
        self._route(lane, read_reply(raw))

    def _route(self, lane: Lane, reply: dict[str, list[Any]]) -> None:
        now = time.monotonic()
        for key, entries in reply.items():
            if key == lane.wake_key:
                if entries:
                    last = entries[-1][0]
                    lane.wake_id = last.decode() if isinstance(last, bytes) else str(last)
                continue
            sub = lane.subs.get(key)
            if sub is None:
                continue
            sub.cursor.quiet_since = now
            try:
                events = sub.cursor.accept(entries)
            except ProtocolError as exc:
                self._drop(lane, key, exc)
                continue
            for event in events:
                sub.deliver(event)
            if sub.cursor.done:
                del lane.subs[key]

    def _fail_all(self, lane: Lane, exc: BaseException) -> None:
        for key in list(lane.subs):
            self._drop(lane, key, exc)

    @staticmethod
    def _drop(lane: Lane, key: str, exc: BaseException) -> None:
        sub = lane.subs.pop(key, None)
        if sub is not None:
            sub.deliver(exc)

    async def _check_status(self, lane: Lane) -> None:
        """Status hashes of the jobs quiet for ``status_interval_s`` (and of new ones):
        a job that ended without a final event gets one from its status."""
        now = time.monotonic()
        every = self.status_interval_s
        due = [
            (key, sub)
            for key, sub in lane.subs.items()
            if not sub.cursor.status_checked or now - sub.cursor.quiet_since >= every
        ]
        if not due:
            return
        pipe = self.conn.pipeline(transaction=False)
        for _, sub in due:
            pipe.hgetall(sub.cursor.status_key)
        hashes = await pipe.execute()
        ended = []
        for (key, sub), data in zip(due, hashes, strict=True):
            cursor = sub.cursor
            cursor.status_checked, cursor.quiet_since = True, now
            if data:
                cursor.missing_since = None
            elif cursor.missing_since is None:
                cursor.missing_since = now
            elif now - cursor.missing_since >= self.missing_timeout_s:
                self._drop(lane, key, JobNotFound(cursor.job_id))
                continue
            status = _status_or_none(data)
            if status is not None and status.state.terminal:
                cursor.ended = status
                ended.append(key)
        if ended:
            await self._end_from_status(lane, ended)

    async def _end_from_status(self, lane: Lane, keys: list[str]) -> None:
        """Read the ended jobs' streams to their end (the daemon writes the final event
        before the status); those with no final event get one made from the status."""
        left = [k for k in keys if k in lane.subs]
        while left:
            streams: dict[Any, Any] = {key: lane.subs[key].cursor.last_id for key in left}
            reply = read_reply(await self.conn.xread(streams, count=READ_COUNT))
            self._route(lane, reply)
            full = {k for k, entries in reply.items() if len(entries) >= READ_COUNT}
            for key in [k for k in left if k not in full and k in lane.subs]:
                sub = lane.subs.pop(key)
                sub.deliver(sub.cursor.final_from_status())
            left = [k for k in left if k in full and k in lane.subs]


def _status_or_none(data: dict[Any, Any]) -> JobStatus | None:
    try:
        return JobStatus.from_hash(data) if data else None
    except ValueError:
        return None


@contextlib.asynccontextmanager
async def running(hub: Hub) -> AsyncIterator[Hub]:
    """``hub`` reading on a task for the duration of the block."""
    task = asyncio.ensure_future(hub.run())
    try:
        yield hub
    finally:
        hub.stop()
        with contextlib.suppress(*OUTAGE_ERRORS):
            await hub.wake_all()  # end the reads in flight now, not at their block's end
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
