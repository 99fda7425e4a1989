"""A deployment laid out in partitions, as the producers' layout tests see it (the
fixture ``partitioned`` in tests/producers/conftest.py makes one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchd.producers.keys import Keys

# The partitions of the partitioned deployments: more than one, so jobs spread.
PARTITIONS = 3


@dataclass
class Partitioned:
    """A deployment laid out in PARTITIONS partitions: its URL, a client of the same kind
    the producers open (``admin``: a RedisCluster on a cluster), and its key names."""

    kind: str
    url: str
    admin: Any
    keys: Keys

    @property
    def cluster(self) -> bool:
        return self.kind == "cluster"
