"""The key layout of a deployment, stored in Redis so that every process agrees on it.

How many partitions each queue has decides where a job's keys are
(:mod:`batchd.producers.keys`): a producer that assumed another count would add jobs
no daemon reads, and follow ids at keys nothing writes. So the count is not a setting
each process keeps, but a fact of the deployment, in ``<prefix>:layout``: the first
daemon writes its ``queue.partitions`` there (``SET NX``), a daemon configured otherwise
refuses to start, and clients read it once when they first need a key. Absent, the
layout is one partition. Whether names carry hash tags follows from the client: always
on Redis Cluster, else only with more than one partition.
"""

from __future__ import annotations

import json
from typing import Any

import redis
import redis.asyncio as aioredis

from batchd.producers.connection.factory import is_cluster
from batchd.producers.keys import MAX_PARTITIONS, Keys


class LayoutMismatch(RuntimeError):
    """The partitions configured differ from those the deployment's data was laid out with."""


def keys_for(client: redis.Redis, prefix: str) -> Keys:
    """The key names of the deployment ``client`` reaches, under ``prefix``."""
    stored: Any = client.get(Keys(prefix).layout)
    return Keys(prefix, _partitions(stored, prefix), tagged=is_cluster(client))


async def async_keys_for(client: aioredis.Redis, prefix: str) -> Keys:
    """Asyncio twin of :func:`keys_for`."""
    stored: Any = await client.get(Keys(prefix).layout)
    return Keys(prefix, _partitions(stored, prefix), tagged=is_cluster(client))


def claim_layout(client: redis.Redis, prefix: str, partitions: int) -> Keys:
    """Store ``partitions`` as the deployment's layout unless one is stored already;
    the key names of the layout in force. LayoutMismatch when the stored one differs."""
    key = Keys(prefix).layout
    client.set(key, json.dumps({"partitions": partitions}), nx=True)
    stored = _partitions(client.get(key), prefix)
    if stored != partitions:
        raise LayoutMismatch(
            f"queue.partitions is {partitions} but the data under prefix {prefix!r} is laid "
            f"out in {stored} partition(s) ({key}); set queue.partitions = {stored}, or "
            f"change the layout only with every queue empty (delete {key} first)"
        )
    return Keys(prefix, partitions, tagged=is_cluster(client))


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
