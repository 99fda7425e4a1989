"""One look at the fleet: queues, live daemons and gateways, in two pipelined round trips.

What ``batchd top`` shows, plus what an overview needs: each queue's entries added and
read so far (Redis 7's counters, from which the sampler makes rates), its oldest
waiting entry, and how its first waiting entries split by priority band. Cheap at any
depth: a refresh touches a queue's XINFO replies and at most ``band_sample`` entries,
never the whole stream, and no key is searched for. New queues, daemons and gateways
(their heartbeat keys, batchd.producers.gateway.serving.beat) are found by a SCAN of the
keyspace every ``discovery_s`` (a daemon also shows up at once as a consumer of a known
queue). A queue of several partitions is one row: each partition's stream is read as
above, and the rows are summed. Read-only: nothing here writes a key.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import redis.asyncio as aioredis

from batchd.producers.gateway.fleet import get_many
from batchd.producers.keys import CONSUMER_GROUP, Keys, is_name

SCAN_COUNT = 1000
# A priority as any producer writes it (orjson's compact form, or with spaces).
_PRIORITY = re.compile(rb'"priority"\s*:\s*(-?\d+)')
BANDS = ("high", "normal", "low")


@dataclass(frozen=True)
class QueueRow:
    """A queue stream. ``unread``: entries no daemon has read (the group's lag);
    ``pending``: read, not yet acked (running); ``added``/``read``: Redis's running
    totals (None before Redis 7); ``bands``: the first ``sampled`` unread entries by
    priority band (high > 0 > low)."""

    name: str
    length: int
    unread: int
    pending: int
    added: int | None
    read: int | None
    oldest_waiting_at: float | None
    bands: dict[str, int]
    sampled: int
    consumers: int


@dataclass(frozen=True)
class DaemonRow:
    """A live daemon, from its heartbeat JSON (fields a daemon does not publish yet are
    None: the page shows a dash)."""

    consumer: str
    beat: dict[str, Any]
    beat_age_s: float

    def get(self, name: str) -> Any:
        return self.beat.get(name)

    @property
    def state(self) -> str:
        beat = self.beat
        if beat.get("draining"):  # a drain is a stop that lets every held job finish
            return "draining"
        if beat.get("stopping"):
            return "stopping"
        if beat.get("redis_down"):
            return "redis down"
        if beat.get("paused"):
            return "paused"
        return "busy" if beat.get("busy") else "idle"

    @property
    def last_step_age_s(self) -> float | None:
        at = self.beat.get("last_step_at")
        at_beat = self.beat.get("at")
        if not isinstance(at, (int, float)) or not isinstance(at_beat, (int, float)):
            return None
        return max(0.0, at_beat - at + self.beat_age_s)

    @property
    def controls(self) -> tuple[str, ...]:
        """The controls the daemon says it obeys (heartbeat ``controls``)."""
        named = self.beat.get("controls")
        return tuple(str(c) for c in named) if isinstance(named, list) else ()


@dataclass(frozen=True)
class Fleet:
    at: float
    queues: list[QueueRow]
    daemons: list[DaemonRow]
    dead_letters: int
    took_s: float = 0.0
    # The live gateways' heartbeats (name, host, pid, version, queue, at), by name.
    gateways: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Prober:
    """Takes :class:`Fleet` snapshots of one Redis; remembers what discovery found."""

    redis: aioredis.Redis
    keys: Keys
    discovery_s: float = 15.0
    band_sample: int = 500
    known_queues: set[str] = field(default_factory=set)
    known_daemons: set[str] = field(default_factory=set)
    known_gateways: set[str] = field(default_factory=set)
    discovered_at: float = float("-inf")

    def forget(self) -> None:
        """Drop what discovery found (the names changed: a new layout): the next probe
        discovers again."""
        self.known_queues.clear()
        self.known_daemons.clear()
        self.known_gateways.clear()
        self.discovered_at = float("-inf")

    async def probe(self) -> Fleet:
        """The fleet now; runs discovery first when it is due."""
        started = time.perf_counter()
        if time.monotonic() - self.discovered_at >= self.discovery_s:
            await self.discover()
        queues = sorted(self.known_queues)
        parts = {q: self.keys.queue_partitions(q) for q in queues}
        streams = [stream for q in queues for stream in parts[q]]
        first = await self._first_round(streams)
        consumers = {c for stream in streams for c in first.consumers.get(stream, ())}
        beats = await self._beats(consumers - set(first.beats), first.beats)
        named = {str(q) for beat in beats.values() for q in beat.get("queues") or []}
        for extra in sorted(n for n in named - set(queues) if is_name(n)):
            self.known_queues.add(extra)  # a daemon's queue not written to yet: next time
        waiting = await self._waiting(streams, first)
        now = time.time()
        daemons = [DaemonRow(name, beat, _age(beat, now)) for name, beat in sorted(beats.items())]
        rows = {stream: _queue_row(stream, first, waiting.get(stream)) for stream in streams}
        return Fleet(
            at=now,
            queues=[_summed(q, [rows[stream] for stream in parts[q]], first) for q in queues],
            daemons=daemons,
            dead_letters=first.dead_letters,
            took_s=time.perf_counter() - started,
            gateways=[first.gateways[name] for name in sorted(first.gateways)],
        )

    async def discover(self) -> None:
        """Walk the keyspace (SCAN, server-side MATCH) for queues and heartbeats: once
        unpartitioned, else once more per partition (its queues carry its hash tag)."""
        patterns = [self.keys.discovery_pattern]
        if self.keys.tagged:
            patterns += self.keys.queue_patterns()
        queues: set[str] = set()
        daemons: set[str] = set()
        gateways: set[str] = set()
        for pattern in patterns:
            async for raw in self.redis.scan_iter(match=pattern, count=SCAN_COUNT):
                self._found(raw.decode(errors="replace"), queues, daemons, gateways)
        self.known_queues = {q for q in queues if is_name(q)}
        self.known_daemons = daemons
        self.known_gateways = gateways
        self.discovered_at = time.monotonic()

    def _found(self, name: str, queues: set[str], daemons: set[str], gateways: set[str]) -> None:
        """File one key discovery found under what it names."""
        if (queue := self.keys.queue_name(name)) is not None:
            queues.add(queue[0])
        elif name.startswith(daemon_prefix := self.keys.daemon("")):
            daemons.add(name.removeprefix(daemon_prefix))
        elif name.startswith(gateway_prefix := self.keys.gateway("")):
            gateways.add(name.removeprefix(gateway_prefix))

    async def _first_round(self, queues: list[str]) -> _FirstRound:
        """XINFO of each queue stream (``queues``: stream names), the heartbeats, and the
        dead letters' count."""
        daemons, gateways = sorted(self.known_daemons), sorted(self.known_gateways)
        dead = self.keys.dead_streams()
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in queues:
                pipe.xinfo_stream(stream)
                pipe.xinfo_groups(stream)
                pipe.xinfo_consumers(stream, CONSUMER_GROUP)
            for consumer in daemons:
                pipe.get(self.keys.daemon(consumer))
            for gateway in gateways:
                pipe.get(self.keys.gateway(gateway))
            for stream in dead:
                pipe.xlen(stream)
            replies = await pipe.execute(raise_on_error=False)
        out = _FirstRound()
        for i, name in enumerate(queues):
            info, groups, consumers = replies[3 * i : 3 * i + 3]
            out.info[name] = info if isinstance(info, dict) else {}
            out.group[name] = _our_group(groups)
            out.consumers[name] = [
                c["name"].decode(errors="replace") for c in _list(consumers) if "name" in c
            ]
        at = 3 * len(queues)
        for consumer, value in zip(daemons, replies[at : at + len(daemons)], strict=True):
            beat = _json_object(value)
            if beat is not None:
                out.beats[consumer] = beat
        at += len(daemons)
        for gateway, value in zip(gateways, replies[at : at + len(gateways)], strict=True):
            beat = _json_object(value)
            if beat is not None:  # None: it stopped or expired since the discovery
                out.gateways[gateway] = beat
        counts = replies[len(replies) - len(dead) :]
        out.dead_letters = sum(n for n in counts if isinstance(n, int))
        return out

    async def _beats(
        self, consumers: set[str], known: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """``known`` plus the heartbeats of consumers discovery has not seen yet."""
        beats = dict(known)
        fresh = sorted(consumers)
        if not fresh:
            return beats
        found = [self.keys.daemon(c) for c in fresh]
        values = await get_many(self.redis, found)
        for consumer, value in zip(fresh, values, strict=True):
            beat = _json_object(value)
            if beat is not None:
                beats[consumer] = beat
                self.known_daemons.add(consumer)
        return beats

    async def _waiting(self, queues: list[str], first: _FirstRound) -> dict[str, list[Any]]:
        """The first unread entries of each queue stream (the second round trip)."""
        if not queues or self.band_sample <= 0:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in queues:
                group = first.group.get(name)
                last = _text(group.get("last-delivered-id")) if group else None
                start = f"({last}" if last and last != "0-0" else "-"
                pipe.xrange(name, min=start, count=self.band_sample)
            replies = await pipe.execute(raise_on_error=False)
        return {q: _list(r) for q, r in zip(queues, replies, strict=True)}


@dataclass
class _FirstRound:
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    group: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    consumers: dict[str, list[str]] = field(default_factory=dict)
    beats: dict[str, dict[str, Any]] = field(default_factory=dict)
    gateways: dict[str, dict[str, Any]] = field(default_factory=dict)
    dead_letters: int = 0


def _queue_row(name: str, first: _FirstRound, waiting: list[Any] | None) -> QueueRow:
    info, group = first.info.get(name, {}), first.group.get(name)
    length = int(info.get("length") or 0)
    pending = int(group.get("pending") or 0) if group else 0
    lag = group.get("lag") if group else None
    entries = waiting or []
    unread = int(lag) if lag is not None else (len(entries) if not group else length - pending)
    bands = band_counts(fields for _, fields in entries)
    oldest = _entry_time(entries[0][0]) if entries else None
    return QueueRow(
        name=name,
        length=length,
        unread=unread,
        pending=pending,
        added=_int_or_none(info.get("entries-added")),
        read=_int_or_none(group.get("entries-read")) if group else None,
        oldest_waiting_at=oldest,
        bands=bands,
        sampled=len(entries),
        consumers=len(first.consumers.get(name, ())),
    )


def _summed(name: str, rows: list[QueueRow], first: _FirstRound) -> QueueRow:
    """Queue ``name``'s row from its partitions' (named by stream): counts summed, the
    oldest waiting entry of any, each consumer counted once."""
    if len(rows) == 1:
        return replace(rows[0], name=name)
    consumers = {c for row in rows for c in first.consumers.get(row.name, ())}
    oldest = [row.oldest_waiting_at for row in rows if row.oldest_waiting_at is not None]
    return QueueRow(
        name=name,
        length=sum(row.length for row in rows),
        unread=sum(row.unread for row in rows),
        pending=sum(row.pending for row in rows),
        added=_sum_or_none(row.added for row in rows),
        read=_sum_or_none(row.read for row in rows),
        oldest_waiting_at=min(oldest, default=None),
        bands={band: sum(row.bands[band] for row in rows) for band in BANDS},
        sampled=sum(row.sampled for row in rows),
        consumers=len(consumers),
    )


def _sum_or_none(values: Iterable[int | None]) -> int | None:
    """The sum, None when one is unknown."""
    known = list(values)
    return None if None in known else sum(v or 0 for v in known)


def band_counts(entries: Iterable[dict[bytes, bytes]]) -> dict[str, int]:
    """How many of the entries are high (priority > 0), normal (0) or low (< 0) priority;
    read with a regular expression, not a JSON parse, to stay cheap per refresh."""
    counts = dict.fromkeys(BANDS, 0)
    for fields in entries:
        payload = fields.get(b"job", b"") if isinstance(fields, dict) else b""
        found = _PRIORITY.search(payload)
        priority = int(found.group(1)) if found else 0
        counts["high" if priority > 0 else "low" if priority < 0 else "normal"] += 1
    return counts


def _our_group(groups: Any) -> dict[str, Any] | None:
    return next((g for g in _list(groups) if g.get("name") == CONSUMER_GROUP.encode()), None)


def _list(reply: Any) -> list[Any]:
    return reply if isinstance(reply, list) else []


def _json_object(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, (bytes, str)):
        return None
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _age(beat: dict[str, Any], now: float) -> float:
    at = beat.get("at")
    return max(0.0, now - at) if isinstance(at, (int, float)) else float("nan")


def _entry_time(entry_id: bytes | str) -> float:
    """The Unix time a stream entry was added (its id's milliseconds part)."""
    return int(_text(entry_id).split("-", 1)[0]) / 1000


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
