"""Every Redis key and channel name of the wire protocol, in one place.

With the default prefix ``batchd``:

==============================  ==========  =============================================
key                             type        holds
==============================  ==========  =============================================
batchd:queue:<queue>            stream      jobs: ``job <JobRequest JSON>``; group ``batchd``
batchd:job:<id>                 hash        status: state, error, timestamps, daemon, ...
batchd:job:<id>:events          stream      one entry per token, then the final event; entry id
                                            ``0-<seq+1>``, field ``event`` (Event JSON)
batchd:job:<id>:tokens          channel     the same Event JSON, PUBLISHed (latency hint only)
batchd:cancel                   stream      cancellation requests: entries ``id <job id>``
batchd:daemon:<consumer>        string      heartbeat JSON of a live daemon, with a TTL
batchd:dead                     stream      dead letters: ``id``, ``queue``, ``error``, ``payload``
batchd:layout                   string      the key layout, JSON ``{"partitions": N}`` (absent: 1)
==============================  ==========  =============================================

**Partitioned layouts** (a queue of N > 1 partitions, or any layout on Redis Cluster):
every script touches a job's keys together with a queue stream, and Cluster runs a script
only on keys of one hash slot. So each of those names carries the hash tag of one of N
partitions, ``batchd:{<tag>}:queue:<queue>``, ``batchd:{<tag>}:job:<id>`` (and its
``:events``, ``:tokens``), ``batchd:{<tag>}:cancel``, ``batchd:{<tag>}:dead``. A job
belongs to partition ``crc32(id) mod N``; partition k's tag is the first string
``<k>.<j>`` (j = 0, 1, ...) whose hash slot lies in the k-th of N equal ranges of the
16384 slots, so the partitions spread over a cluster's primaries as its slots do. Anyone
who knows the id and N finds the job's keys (docs/cluster.md has the rule for other
languages). The heartbeat, control and layout keys are read one at a time and carry no tag.

Keys also names the keys of batchd's other parts, untagged: the gateway's records
(``gateway:*``, batchd.producers.gateway.store), the dashboard's (``dashboard:*``,
batchd.producers.dashboard.records.names) and the bulk workers' liveness (``bulk:*``,
batchd.producers.bulk_liveness).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TypeGuard

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from batchd.config.limits import NAME_PATTERN
from batchd.producers.errors import ValidationError

CONSUMER_GROUP = "batchd"
DEFAULT_PREFIX = "batchd"
DEFAULT_QUEUE = "default"
JOB_FIELD = "job"
EVENT_FIELD = "event"
CANCEL_FIELD = "id"
# The status hash's field naming the job's queue entry (its stream id): written with the
# entry at submit, at pickup, and where an entry Redis lost is added again.
ENTRY_FIELD = "entry"
# Cancellation requests are hints (the status hash is the truth): trim the stream near this.
CANCEL_MAXLEN = 10_000

_NAME = re.compile(NAME_PATTERN)


def is_name(value: object) -> TypeGuard[str]:
    """A valid job id or queue name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``, nothing after.

    ``fullmatch``, not ``match``: Python's ``$`` also matches before a trailing newline.
    """
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


# A queue's priority lane: the stream a job with priority > 0 is added to, read before
# the queue itself, so priority reaches past any backlog (docs/durability.md).
PRIORITY_LANE_SUFFIX = ".priority"


def lane(queue: str, priority: int) -> str:
    """The queue name a job of ``priority`` is added to: ``queue``'s priority lane for a
    priority above 0 (when the lane's name is valid), else ``queue``."""
    name = f"{queue}{PRIORITY_LANE_SUFFIX}"
    return name if priority > 0 and is_name(name) else queue


def lanes(queues: list[str]) -> list[str]:
    """The queue names a daemon serving ``queues`` reads, priority lanes first."""
    high = [lane(queue, 1) for queue in queues]
    return [name for name in high if name not in queues] + list(queues)


def check_name(kind: str, value: str) -> str:
    """``value`` if it is a valid job id or queue name, else ValidationError naming ``kind``."""
    if not is_name(value):
        raise ValidationError(
            kind,
            "must be 1-128 of A-Z a-z 0-9 . _ - (starting with a letter or digit)",
            value=value,
        )
    return value


# The most partitions a queue may have: every daemon reads each partition of its queues.
MAX_PARTITIONS = 64
# Job ids whose partition one Keys remembers: above a daemon's running jobs and a
# gateway's followed ones, so each id's crc32 is computed once while its job is live.
PARTITION_CACHE = 4096


@dataclass(frozen=True)
class _Fixed:
    """A name that depends on the prefix alone: ``<prefix>:<suffix>``."""

    suffix: str

    def __get__(self, keys: Keys, owner: type[Keys] | None = None) -> str:
        return f"{keys.prefix}:{self.suffix}"


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix and layout; every producer and daemon builds names here.

    ``partitions`` is the number of partitions of every queue; ``tagged`` gives the
    partitioned names (see the module's docstring): true on Redis Cluster, and whenever
    ``partitions`` is above 1. The default, one untagged partition, is the layout of a
    single Redis (and of a Sentinel deployment's master).
    """

    prefix: str = DEFAULT_PREFIX
    partitions: int = 1
    tagged: bool = False
    # Per partition: what its names start with, ``<prefix>:`` or ``<prefix>:{<tag>}:``.
    _heads: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # Checked job id -> its partition: the daemon names each running job's keys every
    # step. Emptied when full (a bound, not an LRU: the live ids come straight back).
    _partition_of: dict[str, int] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1..{MAX_PARTITIONS}, not {self.partitions}")
        if self.partitions > 1 and not self.tagged:
            object.__setattr__(self, "tagged", True)
        heads = tuple(
            f"{self.prefix}:{{{partition_tag(k, self.partitions)}}}:"
            if self.tagged
            else f"{self.prefix}:"
            for k in range(self.partitions)
        )
        object.__setattr__(self, "_heads", heads)

    def head(self, partition: int) -> str:
        """What partition ``partition``'s names start with, ``<prefix>:`` or
        ``<prefix>:{<tag>}:``: a name built on it lies in the partition's hash slot."""
        return self._heads[partition]

    layout = _Fixed("layout")
    # SCAN pattern of every live daemon's heartbeat key.
    daemon_pattern = _Fixed("daemon:*")
    # Sorted set of the gateway's file names in its files folder, by the time they expire.
    gateway_expiring = _Fixed("gateway:expiring")
    # The dashboard's audit trail (a stream) and its re-drives' records (a hash).
    dashboard_audit = _Fixed("dashboard:audit")
    dashboard_redrives = _Fixed("dashboard:redrives")
    # The lock one bulk worker holds while it reaps dead workers' runs.
    bulk_reaping = _Fixed("bulk:reaping")

    # Every name a caller passes is checked here, so no id can reach into another job's
    # keys (``X:events`` is job X's events stream) whoever builds the key.

    def partition(self, job_id: str) -> int:
        """The partition job ``job_id`` belongs to: ``crc32(id) mod partitions``."""
        if self.partitions == 1:
            return 0
        if not isinstance(job_id, str):  # may not be hashable: refused before the cache
            check_name("id", job_id)
        cached = self._partition_of.get(job_id)
        if cached is not None:
            return cached
        partition = zlib.crc32(check_name("id", job_id).encode()) % self.partitions
        if len(self._partition_of) >= PARTITION_CACHE:
            self._partition_of.clear()
        self._partition_of[job_id] = partition
        return partition

    def queue(self, name: str = DEFAULT_QUEUE, partition: int = 0) -> str:
        """Partition ``partition`` of queue ``name`` (the queue itself when unpartitioned)."""
        return f"{self._heads[partition]}queue:{check_name('queue', name)}"

    def queue_for(self, name: str, job_id: str) -> str:
        """The partition of queue ``name`` that job ``job_id`` is added to."""
        return self.queue(name, self.partition(job_id))

    def queue_partitions(self, name: str = DEFAULT_QUEUE) -> list[str]:
        """Every partition's stream of queue ``name``."""
        return [self.queue(name, k) for k in range(self.partitions)]

    def queue_name(self, stream: bytes | str) -> tuple[str, int] | None:
        """``(queue, partition)`` of a queue stream's name; None for any other key."""
        text = stream.decode() if isinstance(stream, bytes) else stream
        for k, head in enumerate(self._heads):
            start = f"{head}queue:"
            if text.startswith(start) and is_name(name := text[len(start) :]):
                return name, k
        return None

    def queue_patterns(self) -> list[str]:
        """SCAN patterns matching every queue stream (one per partition)."""
        return [f"{_glob_escape(head)}queue:*" for head in self._heads]

    @property
    def discovery_pattern(self) -> str:
        """SCAN pattern of every untagged ``daemon:``, ``queue:`` and ``gateway:`` key:
        one walk finds the heartbeats, and the queues of an unpartitioned layout."""
        return f"{_glob_escape(self.prefix)}:[dqg]*"

    def job_pattern(self, id_start: str = "") -> str:
        """SCAN pattern of every job's status hash whose id starts with ``id_start``,
        in whichever partition (it matches the ``:events`` streams too: SCAN by type)."""
        tag = "{*}:" if self.tagged else ""
        return f"{_glob_escape(self.prefix)}:{tag}job:{_glob_escape(id_start)}*"

    @property
    def cancel(self) -> str:
        """The cancellation stream of partition 0 (the only one when unpartitioned)."""
        return self.cancel_stream(0)

    def cancel_stream(self, partition: int) -> str:
        return f"{self._heads[partition]}cancel"

    def cancel_for(self, job_id: str) -> str:
        """The cancellation stream a cancel of ``job_id`` is added to (its partition's)."""
        return self.cancel_stream(self.partition(job_id))

    def cancel_streams(self) -> list[str]:
        return [self.cancel_stream(k) for k in range(self.partitions)]

    @property
    def dead(self) -> str:
        """The dead-letter stream of partition 0 (the only one when unpartitioned)."""
        return self.dead_stream(0)

    def dead_stream(self, partition: int) -> str:
        return f"{self._heads[partition]}dead"

    def dead_for(self, job_id: str) -> str:
        return self.dead_stream(self.partition(job_id))

    def dead_streams(self) -> list[str]:
        return [self.dead_stream(k) for k in range(self.partitions)]

    @property
    def tokens_pattern(self) -> str:
        """PSUBSCRIBE pattern of every job's token channel (Cluster's sharded channels
        have no pattern subscriptions)."""
        return f"{self.prefix}:{{*}}:job:*:tokens" if self.tagged else f"{self.prefix}:job:*:tokens"

    def job(self, job_id: str) -> str:
        return _job_key(self._job_head(job_id), job_id)

    def events(self, job_id: str) -> str:
        return _job_key(self._job_head(job_id), job_id, ":events")

    def tokens(self, job_id: str) -> str:
        return _job_key(self._job_head(job_id), job_id, ":tokens")

    def job_head(self, job_id: str) -> str:
        """What every key of job ``job_id`` starts with before ``job:<id>``: a script that
        builds a job's key names from its id takes this."""
        return self._job_head(job_id)

    def _job_head(self, job_id: str) -> str:
        if self.partitions == 1:
            return self._heads[0]
        return self._heads[self.partition(job_id)]

    def daemon(self, consumer: str) -> str:
        return f"{self.prefix}:daemon:{consumer}"

    def gateway(self, name: str) -> str:
        """A gateway process's heartbeat (batchd.producers.gateway.serving.beat)."""
        return f"{self.prefix}:gateway:alive:{name}"

    def control(self, consumer: str) -> str:
        """A daemon's requested state (pause, drain: batchd.daemon.fleet.controls); under
        ``control:``, since every ``daemon:*`` key is read as a heartbeat."""
        return f"{self.prefix}:control:{consumer}"

    # The gateway's records (batchd.producers.gateway.store): ids are checked there.

    def gateway_file(self, file_id: str) -> str:
        return f"{self.prefix}:gateway:file:{file_id}"

    def gateway_batch(self, batch_id: str) -> str:
        return f"{self.prefix}:gateway:batch:{batch_id}"

    def gateway_batches(self, owner: str) -> str:
        """Sorted set of one owner's batch ids by creation time."""
        return f"{self.prefix}:gateway:batches:{owner}"

    def gateway_files(self, owner: str) -> str:
        """Sorted set of one owner's file ids by creation time (``GET /v1/files``)."""
        return f"{self.prefix}:gateway:files:{owner}"

    @property
    def gateway_batches_pattern(self) -> str:
        """SCAN pattern of every owner's batch index."""
        return f"{_glob_escape(self.prefix)}:gateway:batches:*"

    def gateway_wake(self, token: str, partition: int | None) -> str:
        """The wake stream of the gateway reader ``token`` (batchd.producers.gateway.serving
        .hub) for partition ``partition``: in its hash slot, as a Cluster's blocked read
        reaches the keys of one slot; ``None``: untagged, one read following every
        partition."""
        head = f"{self.prefix}:" if partition is None else self._heads[partition]
        return f"{head}gateway:wake:{token}"

    # A bulk worker's liveness (batchd.producers.bulk_liveness), on rq's Redis.

    def bulk_worker(self, name: str) -> str:
        return f"{self.prefix}:bulk:worker:{name}"

    @property
    def bulk_worker_pattern(self) -> str:
        return f"{_glob_escape(self.prefix)}:bulk:worker:*"

    def bulk_running(self, job_id: str) -> str:
        """Alive while the process running rq job ``job_id`` is."""
        return f"{self.prefix}:bulk:running:{job_id}"


def event_id(seq: int) -> str:
    """Stream id of event ``seq``: Redis refuses an id not above the last, so no duplicate."""
    return f"0-{seq + 1}"


def seq_of(entry_id: bytes | str) -> int:
    """Inverse of :func:`event_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[1]) - 1


@lru_cache(maxsize=MAX_PARTITIONS * MAX_PARTITIONS)
def partition_tag(partition: int, partitions: int) -> str:
    """The hash tag of partition ``partition`` of ``partitions``: the first ``<k>.<j>``
    whose slot lies in the k-th of ``partitions`` equal ranges of Cluster's slots."""
    j = 0
    while (
        key_slot(f"{partition}.{j}".encode()) * partitions // REDIS_CLUSTER_HASH_SLOTS != partition
    ):
        j += 1
    return f"{partition}.{j}"


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a SCAN/PSUBSCRIBE glob pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _job_key(head: str, job_id: str, suffix: str = "") -> str:
    """A job's key, its id checked. Cached: a daemon names each running job's three keys
    every step (a refused id raises, and is not cached; one that is not a string, which
    may not be hashable, is refused before the cache)."""
    if not isinstance(job_id, str):
        check_name("id", job_id)
    return _checked_job_key(head, job_id, suffix)


@lru_cache(maxsize=16384)
def _checked_job_key(head: str, job_id: str, suffix: str) -> str:
    return f"{head}job:{check_name('id', job_id)}{suffix}"
