"""What the gateway knows of the fleet: live daemons' models, and how deep the queue is.

Both come from Redis alone: a daemon is live while its heartbeat key exists
(``<prefix>:daemon:<consumer>``, JSON with ``model`` and ``queues``), and the
queue's depth is its consumer group's ``lag`` (entries no daemon has read
yet; XLEN minus pending before Redis 7), summed over the queue's partitions.
Heartbeats are read at most once per ``cache_s`` and the backlog once per
``backlog_cache_s``, by one request while the others wait for its answer, so a
burst of requests costs one SCAN and one XINFO (per partition), not one per request.
On a Redis Cluster the SCAN visits every primary, and the heartbeats (one key each,
in any slot) are read with redis-py's ``mget_nonatomic``.

The bulk workers a gateway's batches would run on are known the same way: a worker
keeps ``<prefix>:bulk:worker:<name>`` alive while it runs
(:mod:`batchd.producers.bulk_liveness`); :class:`BulkWorkers` reads those of the rq
queue, so that a batch and ``/health`` say when none is alive.

A model is shown by its public name: a hub id as it is (``org/name``), a local path
by its last part only (``/srv/models/tiny`` is ``tiny``), so no answer reveals the
daemons' file system. A request may name either form, or a path's last part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import PurePath
from typing import Any, Generic, TypeVar

import redis
import redis.asyncio as aioredis
from pydantic import ValidationError

from batchd.producers.bulk_liveness import Liveness, beats_of
from batchd.producers.connection import is_cluster
from batchd.producers.keys import CONSUMER_GROUP, Keys
from batchd.producers.schema import DaemonHeartbeat

SCAN_COUNT = 500
T = TypeVar("T")
# Where the key names come from: fixed, or a coroutine function that reads the
# deployment's layout (an AsyncClient's ``layout``, read once and kept).
KeysSource = Keys | Callable[[], Awaitable[Keys]]


async def keys_from(source: KeysSource) -> Keys:
    """The key names ``source`` gives."""
    return source if isinstance(source, Keys) else await source()


def get_many(conn: Any, found: list[Any]) -> Any:
    """MGET of ``found`` (single keys of any slot): one command, or on a Cluster one per
    slot (``mget_nonatomic``); the values, or (asyncio) an awaitable of them."""
    return conn.mget_nonatomic(found) if is_cluster(conn) else conn.mget(found)


def public_name(model: str) -> str:
    """What a model is called in answers: a local path's last part, a hub id whole."""
    if model.startswith(("/", ".", "~")) or "\\" in model or model.endswith(".gguf"):
        return PurePath(model).name
    return model


def live_beats(values: Iterable[bytes | str | None], queue: str) -> list[DaemonHeartbeat]:
    """The heartbeats among ``values`` (raw heartbeat keys) of daemons consuming ``queue``."""
    found = []
    for value in values:
        if value is None:  # expired since the SCAN
            continue
        try:
            beat = DaemonHeartbeat.model_validate_json(value)
        except ValidationError:  # not a heartbeat: someone else's key under the prefix
            continue
        if queue in beat.queues:
            found.append(beat)
    return found


def names(beats: Iterable[DaemonHeartbeat]) -> dict[str, str]:
    """Every name a request may use for a served model -> its public name. A path's last
    part names it only where one model has that last part. A LoRA adapter a daemon
    serves is the model ``<name>:<adapter>`` for each name of its model."""
    beats = list(beats)
    models = {b.model for b in beats if b.model is not None}
    accepted = {m: public_name(m) for m in models}
    accepted.update({public_name(m): public_name(m) for m in models})
    last: dict[str, set[str]] = {}
    for m in models:
        last.setdefault(PurePath(m).name, set()).add(public_name(m))
    accepted.update({name: next(iter(p)) for name, p in last.items() if len(p) == 1})
    adapters: dict[str, set[str]] = {}
    for b in beats:
        if b.model is not None:
            adapters.setdefault(public_name(b.model), set()).update(b.adapters)
    for alias, public in list(accepted.items()):
        for adapter in adapters.get(public, ()):
            accepted[f"{alias}:{adapter}"] = f"{public}:{adapter}"
    return accepted


def split_adapter(public: str, served: dict[str, str]) -> tuple[str, str | None]:
    """A public name of ``served`` (:func:`names`) -> the model's public name and the
    adapter it names (None: the base model)."""
    model, sep, adapter = public.rpartition(":")
    if sep and model in served.values() and served.get(public) == public:
        return model, adapter
    return public, None


def served_models(conn: redis.Redis, keys: Keys, queue: str) -> dict[str, str]:
    """:func:`names` of the live daemons on ``queue``, read now (the batch runner's view)."""
    found = list(conn.scan_iter(keys.daemon_pattern, count=SCAN_COUNT))
    values: Any = get_many(conn, found) if found else []
    return names(live_beats(values, queue))


class Fleet:
    """Live daemons serving ``queue`` and the queue's backlog, read from Redis."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: KeysSource,
        queue: str,
        *,
        cache_s: float = 1.0,
        backlog_cache_s: float = 0.1,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self._daemons = Cached(self._read_daemons, cache_s)
        self._backlog = Cached(self._read_backlog, backlog_cache_s)

    async def daemons(self) -> list[DaemonHeartbeat]:
        """Daemons with a live heartbeat that consume this gateway's queue."""
        return await self._daemons.get()

    async def _read_daemons(self) -> list[DaemonHeartbeat]:
        pattern = (await keys_from(self.keys)).daemon_pattern
        found = [k async for k in self.redis.scan_iter(pattern, count=SCAN_COUNT)]
        values = await get_many(self.redis, found) if found else []
        return live_beats(values, self.queue)

    async def models(self) -> list[str]:
        """The public names of the models live daemons serve."""
        return sorted(set((names(await self.daemons())).values()))

    async def resolve(self, requested: str) -> str | None:
        """The public name of the served model a request names (its public name, its
        full id, or the last part of its path or hub id); None when no live daemon
        serves it."""
        return names(await self.daemons()).get(requested)

    async def split(self, public: str) -> tuple[str, str | None]:
        """:func:`split_adapter` over the live daemons' names."""
        return split_adapter(public, names(await self.daemons()))

    async def context_of(self, model: str) -> int | None:
        """The context length (``max_model_len``) of ``model`` (a public name), the least
        its daemons' heartbeats report; None when none reports one."""
        found = [
            beat.max_model_len
            for beat in await self.daemons()
            if beat.model and public_name(beat.model) == model and beat.max_model_len
        ]
        return min(found) if found else None

    async def serving(self) -> list[DaemonHeartbeat]:
        """The live daemons that take new jobs: a model loaded, not stopping (nor
        draining), intake not paused by an operator."""
        return [b for b in await self.daemons() if b.model and not (b.stopping or b.paused)]

    async def backlog(self) -> int:
        """Jobs on the queue that no daemon has read yet (as of ``backlog_cache_s`` ago)."""
        return await self._backlog.get()

    async def _read_backlog(self) -> int:
        keys = await keys_from(self.keys)
        lags = await asyncio.gather(*map(self._lag, keys.queue_partitions(self.queue)))
        return sum(lags)

    async def _lag(self, stream: str) -> int:
        """Entries of one queue partition that no daemon has read yet."""
        try:
            groups: Any = await self.redis.xinfo_groups(stream)
        except aioredis.ResponseError:  # no such stream yet: nothing waits
            return 0
        for group in groups:
            name = group.get("name")
            if (name.decode() if isinstance(name, bytes) else name) != CONSUMER_GROUP:
                continue
            if group.get("lag") is not None:
                return int(group["lag"])
            return max(0, int(await self.redis.xlen(stream)) - int(group.get("pending", 0)))
        return int(await self.redis.xlen(stream))


class BulkWorkers:
    """Live bulk workers of one rq queue."""

    def __init__(
        self, redis: aioredis.Redis, prefix: str, rq_queue: str, *, cache_s: float = 1.0
    ) -> None:
        self.redis = redis
        self.liveness = Liveness(prefix)
        self.rq_queue = rq_queue
        self._live = Cached(self._read, cache_s)

    async def live(self) -> list[dict[str, Any]]:
        """The heartbeats of the live workers taking jobs from the rq queue."""
        return await self._live.get()

    async def _read(self) -> list[dict[str, Any]]:
        pattern = self.liveness.worker_pattern
        keys = [k async for k in self.redis.scan_iter(pattern, count=SCAN_COUNT)]
        values = await get_many(self.redis, keys) if keys else []
        return beats_of(values, self.rq_queue)


class Cached(Generic[T]):
    """A value read at most once per ``ttl_s``: concurrent callers of a stale value wait
    for the one read in flight instead of each reading."""

    def __init__(self, read: Callable[[], Awaitable[T]], ttl_s: float) -> None:
        self.read = read
        self.ttl_s = ttl_s
        self._value: T | None = None
        self._at = -float("inf")
        self._lock = asyncio.Lock()

    async def get(self) -> T:
        if self._value is not None and time.monotonic() - self._at < self.ttl_s:
            return self._value
        async with self._lock:
            if self._value is None or time.monotonic() - self._at >= self.ttl_s:
                self._value, self._at = await self.read(), time.monotonic()
            return self._value
