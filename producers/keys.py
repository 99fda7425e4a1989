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
==============================  ==========  =============================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeGuard

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


@dataclass(frozen=True)
class _Fixed:
    """A name that depends on the prefix alone: ``<prefix>:<suffix>``."""

    suffix: str

    def __get__(self, keys: Keys, owner: type[Keys] | None = None) -> str:
        return f"{keys.prefix}:{self.suffix}"


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix; every producer and daemon builds names here."""

    prefix: str = DEFAULT_PREFIX

    cancel = _Fixed("cancel")
    dead = _Fixed("dead")
    # What every queue stream's name starts with (the name follows).
    queue_prefix = _Fixed("queue:")
    # PSUBSCRIBE pattern of every job's token channel.
    tokens_pattern = _Fixed("job:*:tokens")
    # SCAN pattern of every live daemon's heartbeat key.
    daemon_pattern = _Fixed("daemon:*")

    # Every name a caller passes is checked here, so no id can reach into another job's
    # keys (``X:events`` is job X's events stream) whoever builds the key.

    def queue(self, name: str = DEFAULT_QUEUE) -> str:
        return f"{self.queue_prefix}{check_name('queue', name)}"

    def job(self, job_id: str) -> str:
        return _job_key(self.prefix, job_id)

    def events(self, job_id: str) -> str:
        return _job_key(self.prefix, job_id, ":events")

    def tokens(self, job_id: str) -> str:
        return _job_key(self.prefix, job_id, ":tokens")

    def daemon(self, consumer: str) -> str:
        return f"{self.prefix}:daemon:{consumer}"

    def gateway(self, name: str) -> str:
        """A gateway process's heartbeat (batchd.producers.gateway.serving.beat)."""
        return f"{self.prefix}:gateway:alive:{name}"

    def control(self, consumer: str) -> str:
        """A daemon's requested state (pause, drain: batchd.daemon.fleet.controls); under
        ``control:``, since every ``daemon:*`` key is read as a heartbeat."""
        return f"{self.prefix}:control:{consumer}"


def event_id(seq: int) -> str:
    """Stream id of event ``seq``: Redis refuses an id not above the last, so no duplicate."""
    return f"0-{seq + 1}"


def seq_of(entry_id: bytes | str) -> int:
    """Inverse of :func:`event_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[1]) - 1


def _job_key(prefix: str, job_id: str, suffix: str = "") -> str:
    """A job's key, its id checked. Cached: a daemon names each running job's three keys
    every step (a refused id raises, and is not cached; one that is not a string, which
    may not be hashable, is refused before the cache)."""
    if not isinstance(job_id, str):
        check_name("id", job_id)
    return _checked_job_key(prefix, job_id, suffix)


@lru_cache(maxsize=16384)
def _checked_job_key(prefix: str, job_id: str, suffix: str) -> str:
    return f"{prefix}:job:{check_name('id', job_id)}{suffix}"
