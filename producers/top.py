"""``batchd top``: a live view of the fleet, read from Redis alone.

Daemons are found by their heartbeat keys (``<prefix>:daemon:<consumer>``,
JSON written by ``batchd.daemon.fleet.heartbeat``: model, queues, running, waiting, KV
usage, tokens/s, ...); queues by their streams plus every queue a daemon
names. Keys are found with SCAN, never KEYS, so a large keyspace is walked
in small steps instead of blocking Redis (on a Redis Cluster, every primary's).
A queue of several partitions is shown as one: its counts summed over its
partitions, a consumer's over the partitions it reads. Read-only: top never
changes a key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import redis

from batchd.producers.keys import CONSUMER_GROUP, Keys, is_name

# Keys asked for per SCAN call: small steps keep each call short on a busy Redis.
SCAN_COUNT = 500
# ANSI: cursor home, clear screen (live view on a terminal only).
CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class DaemonView:
    """One live daemon: its heartbeat JSON as written, and how old that beat is."""

    consumer: str
    heartbeat: dict[str, Any]
    age_s: float

    def to_dict(self) -> dict[str, Any]:
        return {**self.heartbeat, "consumer": self.consumer, "age_s": round(self.age_s, 3)}


@dataclass(frozen=True)
class ConsumerView:
    """A consumer of a queue's group; ``alive`` when its heartbeat key exists."""

    name: str
    pending: int
    idle_ms: int
    alive: bool


@dataclass(frozen=True)
class QueueView:
    """A queue stream: entries held, entries delivered but not acked (``pending``, the
    XPENDING count), and entries no consumer has read yet (``unread``: the group's lag,
    None before Redis 7 or when Redis cannot tell)."""

    name: str
    length: int
    pending: int
    unread: int | None
    consumers: list[ConsumerView]


@dataclass(frozen=True)
class Snapshot:
    at: float
    daemons: list[DaemonView]
    queues: list[QueueView]

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "daemons": [d.to_dict() for d in self.daemons],
            "queues": [asdict(q) for q in self.queues],
        }


def take_snapshot(
    client: redis.Redis, keys: Keys, *, clock: Callable[[], float] = time.time
) -> Snapshot:
    """Daemons and queues as Redis holds them now (SCANs, then two pipelines)."""
    daemons = _daemons(client, keys, now=clock())
    named = {str(q) for d in daemons for q in d.heartbeat.get("queues") or []}
    names = sorted(n for n in named | _queue_names(client, keys) if is_name(n))
    alive = {d.consumer for d in daemons}
    return Snapshot(clock(), daemons, _queues(client, keys, names, alive=alive))


def _daemons(client: redis.Redis, keys: Keys, *, now: float) -> list[DaemonView]:
    found = sorted(client.scan_iter(match=keys.daemon_pattern, count=SCAN_COUNT))
    with client.pipeline(transaction=False) as pipe:
        for key in found:
            pipe.get(key)
        values = pipe.execute()
    prefix = keys.daemon("")
    out = []
    for key, value in zip(found, values, strict=True):
        beat = _json_object(value)
        if beat is None:  # expired since the SCAN, or not a heartbeat
            continue
        at = beat.get("at")
        age = now - at if isinstance(at, (int, float)) else float("nan")
        out.append(DaemonView(key.decode().removeprefix(prefix), beat, age))
    return out


def _json_object(value: bytes | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _queue_names(client: redis.Redis, keys: Keys) -> set[str]:
    """The queues with a stream in some partition."""
    names = set()
    for pattern in keys.queue_patterns():
        for key in client.scan_iter(match=pattern, count=SCAN_COUNT, _type="STREAM"):
            if (found := keys.queue_name(key)) is not None:
                names.add(found[0])
    return names


def _queues(
    client: redis.Redis, keys: Keys, names: Sequence[str], *, alive: set[str]
) -> list[QueueView]:
    streams = [(name, stream) for name in names for stream in keys.queue_partitions(name)]
    with client.pipeline(transaction=False) as pipe:
        for _, stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            pipe.xinfo_consumers(stream, CONSUMER_GROUP)
        # A queue without its group (or without a stream) answers errors: shown empty.
        replies = pipe.execute(raise_on_error=False)
    parts: dict[str, list[QueueView]] = {name: [] for name in names}
    for i, (name, _) in enumerate(streams):
        length, groups, consumers = replies[3 * i : 3 * i + 3]
        group = _our_group(groups)
        parts[name].append(
            QueueView(
                name=name,
                length=length if isinstance(length, int) else 0,
                pending=int(group["pending"]) if group else 0,
                unread=_int_or_none(group.get("lag")) if group else None,
                consumers=_consumers(consumers, alive=alive),
            )
        )
    return [_summed(name, parts[name]) for name in names]


def _summed(name: str, parts: list[QueueView]) -> QueueView:
    """One queue's view from its partitions': counts summed (unread unknown when one
    partition's is), each consumer once, its pending summed, its idle time the least."""
    if len(parts) == 1:
        return parts[0]
    unread = [p.unread for p in parts]
    consumers: dict[str, ConsumerView] = {}
    for c in (c for p in parts for c in p.consumers):
        if (seen := consumers.get(c.name)) is not None:
            c = ConsumerView(
                c.name, seen.pending + c.pending, min(seen.idle_ms, c.idle_ms), c.alive
            )
        consumers[c.name] = c
    return QueueView(
        name=name,
        length=sum(p.length for p in parts),
        pending=sum(p.pending for p in parts),
        unread=None if None in unread else sum(u or 0 for u in unread),
        consumers=sorted(consumers.values(), key=lambda c: c.name),
    )


def _our_group(groups: Any) -> dict[str, Any] | None:
    if isinstance(groups, Exception):
        return None
    return next((g for g in groups if g["name"] == CONSUMER_GROUP.encode()), None)


def _consumers(reply: Any, *, alive: set[str]) -> list[ConsumerView]:
    if isinstance(reply, Exception):
        return []
    out = []
    for info in reply:
        name = info["name"].decode()
        out.append(ConsumerView(name, int(info["pending"]), int(info["idle"]), name in alive))
    return out


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


# -- text view ---------------------------------------------------------------------------------

DAEMON_HEAD = ("DAEMON", "MODEL", "QUEUES", "STATE", "RUN", "WAIT", "KV", "TOK/S", "HELD", "BEAT")
QUEUE_HEAD = ("QUEUE", "LENGTH", "UNREAD", "PENDING", "CONSUMERS")


def render(snapshot: Snapshot) -> str:
    """The snapshot as two aligned tables, daemons then queues."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snapshot.at))
    lines = [f"batchd top  {stamp}  {len(snapshot.daemons)} daemon(s)", ""]
    daemon_rows = [_daemon_row(d) for d in snapshot.daemons]
    lines += _table(DAEMON_HEAD, daemon_rows) if daemon_rows else ["no live daemon"]
    lines.append("")
    queue_rows = [_queue_row(q) for q in snapshot.queues]
    lines += _table(QUEUE_HEAD, queue_rows) if queue_rows else ["no queue"]
    return "\n".join(lines) + "\n"


def _daemon_row(d: DaemonView) -> list[object]:
    beat = d.heartbeat
    kv = beat.get("kv_usage")
    states = ("draining", "stopping", "redis_down", "paused")
    state = next((s.replace("_", " ") for s in states if beat.get(s)), "up")
    return [
        d.consumer,
        beat.get("model") or "-",
        ",".join(str(q) for q in beat.get("queues") or []) or "-",
        state,
        beat.get("running", "-"),
        beat.get("waiting", "-"),
        f"{kv:.0%}" if isinstance(kv, (int, float)) else "-",
        beat.get("tokens_per_s", "-"),
        beat.get("jobs_held", "-"),
        f"{d.age_s:.1f}s ago",
    ]


def _queue_row(q: QueueView) -> list[object]:
    consumers = ", ".join(
        f"{c.name} ({c.pending} pending{'' if c.alive else ', no heartbeat'})" for c in q.consumers
    )
    unread = "-" if q.unread is None else q.unread
    return [q.name, q.length, unread, q.pending, consumers or "-"]


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [list(head)] + [[str(v) for v in row] for row in rows]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(head))]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return [
        "  ".join(
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(row, widths, numeric, strict=True)
        ).rstrip()
        for row in cells
    ]


def snapshot_json(snapshot: Snapshot) -> str:
    return orjson.dumps(snapshot.to_dict()).decode() + "\n"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) or value == "-"
