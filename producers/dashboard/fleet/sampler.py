"""The overview's clock: one probe of the fleet per refresh, shared by every viewer.

Each tick probes Redis (:mod:`.probe`), turns counters into rates against the previous
tick, adds a sample to the charts' history, and wakes every open overview stream. The
cost of a refresh does not grow with the number of browsers watching: they all get the
same tick, rendered once per kind of viewer (``dashboard.overview``). Bulk workers are
read from rq less often (every ``WORKERS_EVERY_S``), on a thread.

Until a daemon has stored the deployment's key layout
(:mod:`batchd.producers.connection.layout`), each tick reads it again: a dashboard
started before the first daemon of a partitioned deployment switches to its names at
the first tick after that daemon started, with no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from batchd.producers.connection import async_read_layout
from batchd.producers.dashboard.fleet.history import History
from batchd.producers.dashboard.fleet.latency import Finished, Latency, LatencyCollector
from batchd.producers.dashboard.fleet.probe import Fleet, Prober, QueueRow
from batchd.producers.dashboard.fleet.runs import BulkWorker, read_workers
from batchd.producers.dashboard.records.audit import Audit, AuditEntry
from batchd.producers.dashboard.records.dead import DeadLetter, read_letters

log = logging.getLogger(__name__)

WORKERS_EVERY_S = 5.0
RECENT_LETTERS = 5
RECENT_ACTIONS = 8
# Rates (queue in/out, jobs/s) are counted over this many seconds of ticks.
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class QueueFigures:
    """A queue with its rates since the previous tick (None on the first, or before
    Redis 7, which keeps no running totals)."""

    row: QueueRow
    in_per_s: float | None
    out_per_s: float | None


@dataclass(frozen=True)
class Overview:
    """Everything the overview shows at one tick."""

    fleet: Fleet
    queues: list[QueueFigures]
    tokens_per_s: float
    jobs_per_s: float | None
    latency: Latency
    failures: list[Finished]
    letters: list[DeadLetter]
    actions: list[AuditEntry]
    workers: list[BulkWorker]
    workers_note: str
    took_s: float

    @property
    def unread(self) -> int:
        return sum(q.row.unread for q in self.queues)

    @property
    def running(self) -> int:
        return sum(q.row.pending for q in self.queues)


@dataclass(frozen=True)
class _Counters:
    """One tick's running totals: per queue (entries added, entries read), per daemon
    (jobs finished)."""

    at: float
    queues: dict[str, tuple[int | None, int | None]]
    jobs_done: dict[str, int]


class Sampler:
    """Ticks every ``refresh_s`` (see the module doc); ``latest`` is the last tick."""

    def __init__(
        self,
        prober: Prober,
        collector: LatencyCollector,
        audit: Audit,
        sync: redis.Redis,
        *,
        history_points: int,
        refresh_s: float,
        layout_stored: bool = True,
    ) -> None:
        self.prober = prober
        self.layout_stored = layout_stored
        self.collector = collector
        self.audit = audit
        self.sync = sync
        self.refresh_s = refresh_s
        self.history = History(history_points)
        self.latest: Overview | None = None
        self.version = 0
        self._window: deque[_Counters] = deque()
        self._workers: list[BulkWorker] = []
        self._workers_note = ""
        self._workers_at = float("-inf")
        # Set, then replaced, at each new version: waiting takes no lock. (A Condition's
        # wait under wait_for once raised "cannot wait on un-acquired lock" in a stream,
        # cutting it: its lock had been released under it.)
        self._changed = asyncio.Event()

    async def tick(self) -> Overview:
        """Probe once, record the sample, and wake the streams."""
        started = time.perf_counter()
        await self._follow_layout()
        fleet = await self.prober.probe()
        keys = self.prober.keys
        letters = await read_letters(self.prober.redis, keys, count=RECENT_LETTERS)
        actions = await self.audit.recent(RECENT_ACTIONS)
        await self._refresh_workers()
        queues, jobs_per_s = self._rates(fleet)
        latency = self.collector.latency(fleet.at)
        overview = Overview(
            fleet=fleet,
            queues=queues,
            tokens_per_s=sum(_number(d.get("tokens_per_s")) for d in fleet.daemons),
            jobs_per_s=jobs_per_s,
            latency=latency,
            failures=self._failures(letters),
            letters=letters,
            actions=actions,
            workers=self._workers,
            workers_note=self._workers_note,
            took_s=time.perf_counter() - started,
        )
        self.history.add(
            fleet.at,
            tokens_per_s=overview.tokens_per_s if fleet.daemons else None,
            unread=float(overview.unread),
            running=float(overview.running),
            ttft_p50=latency.ttft_p50_s,
            ttft_p95=latency.ttft_p95_s,
            itl_p50=latency.itl_p50_s,
            itl_p95=latency.itl_p95_s,
        )
        self.latest = overview
        self.publish()
        return overview

    def publish(self) -> None:
        """A new version: every stream waiting in :meth:`wait_newer` wakes."""
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """Tick forever; a Redis outage is logged once per kind and retried."""
        failing = ""
        while True:
            began = time.monotonic()
            try:
                await self.tick()
                failing = ""
            except (redis.RedisError, OSError) as exc:
                if type(exc).__name__ != failing:
                    log.warning("overview probe failed: %s", type(exc).__name__)
                failing = type(exc).__name__
            await asyncio.sleep(max(0.05, self.refresh_s - (time.monotonic() - began)))

    async def wait_newer(self, seen: int, timeout: float) -> int:
        """The current version once it is above ``seen`` (or at the timeout)."""
        if self.version <= seen:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
        return self.version

    def _rates(self, fleet: Fleet) -> tuple[list[QueueFigures], float | None]:
        """Queue rates and jobs/s over the ticks of the last RATE_WINDOW_S (steadier than
        one tick to the next)."""
        now = _Counters(
            fleet.at,
            {row.name: (row.added, row.read) for row in fleet.queues},
            {d.consumer: _jobs_done(d.get("jobs_done")) for d in fleet.daemons},
        )
        window = self._window
        window.append(now)
        while fleet.at - window[0].at > RATE_WINDOW_S:
            window.popleft()
        first = window[0]
        span = fleet.at - first.at
        figures = []
        for row in fleet.queues:
            added, read = first.queues.get(row.name, (None, None))
            figures.append(
                QueueFigures(row, _rate(added, row.added, span), _rate(read, row.read, span))
            )
        finished = sum(_finished_since(first.jobs_done.get(c), n) for c, n in now.jobs_done.items())
        return figures, finished / span if span > 0 else None

    def _failures(self, letters: list[DeadLetter]) -> list[Finished]:
        """Jobs seen failing lately, but for those the dead letters already show."""
        lettered = {letter.job_id for letter in letters}
        failed = [f for f in reversed(self.collector.failures) if f.job_id not in lettered]
        return failed[:RECENT_LETTERS]

    async def _follow_layout(self) -> None:
        """Read the stored layout while none was (see the module doc); once it is, the
        prober and the latency collector use its names, and discovery runs again."""
        if self.layout_stored:
            return
        current = self.prober.keys
        keys, self.layout_stored = await async_read_layout(self.prober.redis, current.prefix)
        if not self.layout_stored or keys == current:
            return
        log.info(
            "the key layout is stored now: %d partition(s) per queue; the dashboard uses "
            "its names from this refresh on",
            keys.partitions,
        )
        self.prober.keys = self.collector.keys = keys
        self.prober.forget()

    async def _refresh_workers(self) -> None:
        if time.monotonic() - self._workers_at < WORKERS_EVERY_S:
            return
        self._workers_at = time.monotonic()
        try:
            self._workers = await asyncio.to_thread(read_workers, self.sync)
            self._workers_note = ""
        except (redis.RedisError, OSError, ValueError) as exc:
            self._workers_note = f"bulk workers unreadable: {type(exc).__name__}"


def _rate(before: int | None, now: int | None, span: float) -> float | None:
    if before is None or now is None or span <= 0 or now < before:
        return None
    return (now - before) / span


def _finished_since(before: int | None, now: int) -> int:
    """Jobs a daemon finished since ``before``: none for a daemon not seen then (its
    counter holds its whole life), all for one that restarted (its counter fell)."""
    if before is None:
        return 0
    return now - before if now >= before else now


def _jobs_done(value: Any) -> int:
    return (
        sum(int(v) for v in value.values() if isinstance(v, int)) if isinstance(value, dict) else 0
    )


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0
