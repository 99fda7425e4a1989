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

from dataclasses import dataclass

CONSUMER_GROUP = "batchd"
DEFAULT_PREFIX = "batchd"
DEFAULT_QUEUE = "default"
JOB_FIELD = "job"
EVENT_FIELD = "event"
CANCEL_FIELD = "id"
# Cancellation requests are hints (the status hash is the truth): trim the stream near this.
CANCEL_MAXLEN = 10_000


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix; every producer and daemon builds names here."""

    prefix: str = DEFAULT_PREFIX

    def queue(self, name: str = DEFAULT_QUEUE) -> str:
        return f"{self.prefix}:queue:{name}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:events"

    def tokens(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:tokens"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}:cancel"

    def daemon(self, consumer: str) -> str:
        return f"{self.prefix}:daemon:{consumer}"

    @property
    def daemon_pattern(self) -> str:
        return f"{self.prefix}:daemon:*"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"


def event_id(seq: int) -> str:
    """Stream id of event ``seq``: Redis refuses an id not above the last, so no duplicate."""
    return f"0-{seq + 1}"


def seq_of(entry_id: bytes | str) -> int:
    """Inverse of :func:`event_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[1]) - 1
