"""The key layout of a deployment, stored in Redis so that every process agrees on it.

How many partitions each queue has decides where a job's keys are
(:mod:`batchd.producers.keys`): a producer that assumed another count would add jobs
no daemon reads, and follow ids at keys nothing writes. So the count is not a setting
each process keeps, but a fact of the deployment, in ``<prefix>:layout``: the first
daemon writes its ``queue.partitions`` there (``SET NX``), a daemon configured otherwise
refuses to start, and running daemons write it again should it be lost (a Redis
restarted without persistence, a FLUSHALL, an eviction: :class:`LayoutClaim`).

Clients read it when they first need a key, and keep it once it is stored. Absent, the
layout is one partition, but a client does not keep that answer: it reads again at its
next use, so that a producer started before the first daemon of a partitioned
deployment uses the partitions from the first use after that daemon started. Whether
names carry hash tags follows from the client: always on Redis Cluster, else only with
more than one partition.
"""

from __future__ import annotations

import json
from typing import Any

import redis
import redis.asyncio as aioredis

from batchd.producers.connection.factory import is_cluster
from batchd.producers.keys import MAX_PARTITIONS, Keys


class LayoutError(RuntimeError):
    """A daemon must not serve: the deployment's layout is another, or cannot be stored."""


class LayoutMismatch(LayoutError):
    """The partitions configured differ from those the deployment's data was laid out with."""


class LayoutNotWritable(LayoutError):
    """The daemon's Redis user may not read or store the layout key (ACL, NOPERM)."""


def read_layout(client: redis.Redis, prefix: str) -> tuple[Keys, bool]:
    """The key names of the deployment ``client`` reaches, under ``prefix``, and whether
    its layout is stored: a caller keeps the names only once it is (see the module)."""
    stored: Any = client.get(Keys(prefix).layout)
    return Keys(prefix, _partitions(stored, prefix), tagged=is_cluster(client)), stored is not None


async def async_read_layout(client: aioredis.Redis, prefix: str) -> tuple[Keys, bool]:
    """Asyncio twin of :func:`read_layout`."""
    stored: Any = await client.get(Keys(prefix).layout)
    return Keys(prefix, _partitions(stored, prefix), tagged=is_cluster(client)), stored is not None


def keys_for(client: redis.Redis, prefix: str) -> Keys:
    """The key names of the deployment ``client`` reaches, under ``prefix``, as of now."""
    return read_layout(client, prefix)[0]


async def async_keys_for(client: aioredis.Redis, prefix: str) -> Keys:
    """Asyncio twin of :func:`keys_for`."""
    return (await async_read_layout(client, prefix))[0]


class LayoutClaim:
    """A daemon's layout: the key names of its ``partitions`` (:attr:`keys`, which it uses
    for everything), stored in Redis at start (:meth:`claim`) and kept stored while it
    runs (:meth:`reassert`, with each heartbeat).

    The stored layout is read first and written only when absent, so a daemon whose
    user may only read the key serves once an administrator stored a matching layout,
    and a Redis refusing writes (OOM) is asked no write while a layout is stored.
    """

    def __init__(self, prefix: str, partitions: int, *, tagged: bool) -> None:
        self.prefix = prefix
        self.partitions = partitions
        self.keys = Keys(prefix, partitions, tagged=tagged)
        self.key = Keys(prefix).layout
        self.body = json.dumps({"partitions": partitions})

    @classmethod
    def of(cls, client: redis.Redis, prefix: str, partitions: int) -> LayoutClaim:
        """The claim of a daemon that reaches the deployment through ``client``."""
        return cls(prefix, partitions, tagged=is_cluster(client))

    def claim(self, client: redis.Redis) -> Keys:
        """Store the layout unless one is stored already; :attr:`keys`. LayoutMismatch when
        the stored one differs (or is not a layout), LayoutNotWritable when the user may
        not read or store it; OOM (a refusal that passes) is raised naming the key and
        what to do, other Redis errors as they came."""
        self.reassert(client)
        return self.keys

    def reassert(self, client: redis.Redis) -> bool:
        """Store the layout if it is absent: True when it had to be written (it was lost, or
        never stored). Raises as :meth:`claim` does."""
        try:
            stored: Any = client.get(self.key)
            if stored is None:
                if client.set(self.key, self.body, nx=True):
                    return True
                stored = client.get(self.key)  # another daemon's, written just now
        except redis.exceptions.NoPermissionError as exc:
            raise LayoutNotWritable(
                f"Redis refuses {self.key} to this daemon's user (NOPERM: {exc}): grant "
                f"it the key (ACL SETUSER <user> ~{self.key} +get +set), or have an "
                f"administrator store it once: SET {self.key} '{self.body}' NX"
            ) from None
        except redis.exceptions.OutOfMemoryError as exc:
            raise redis.exceptions.OutOfMemoryError(
                f"cannot store the layout {self.key} ({exc}): free memory or raise maxmemory"
            ) from None
        try:
            found = _partitions(stored, self.prefix)
        except ValueError as exc:
            raise LayoutMismatch(
                f"{exc}; delete it, or store the layout of queue.partitions: "
                f"SET {self.key} '{self.body}'"
            ) from None
        if found != self.partitions:
            raise LayoutMismatch(
                f"queue.partitions is {self.partitions} but the data under prefix "
                f"{self.prefix!r} is laid out in {found} partition(s) ({self.key}); set "
                f"queue.partitions = {found}, or change the layout only with every queue "
                f"empty (delete {self.key} first)"
            )
        return False


def claim_layout(client: redis.Redis, prefix: str, partitions: int) -> Keys:
    """Store ``partitions`` as the deployment's layout unless one is stored already;
    the key names of the layout in force (see :meth:`LayoutClaim.claim`)."""
    return LayoutClaim.of(client, prefix, partitions).claim(client)


def _partitions(stored: Any, prefix: str) -> int:
    """The partition count a stored layout names (1 when none is stored); ValueError
    naming the key for a value batchd did not write."""
    if stored is None:
        return 1
    try:
        partitions = json.loads(stored)["partitions"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"{Keys(prefix).layout} holds {stored!r:.80}, not a layout: {exc}"
        ) from None
    if not isinstance(partitions, int) or not 1 <= partitions <= MAX_PARTITIONS:
        raise ValueError(
            f"{Keys(prefix).layout}: partitions {partitions!r} not in 1..{MAX_PARTITIONS}"
        )
    return partitions
