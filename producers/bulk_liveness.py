"""Which bulk workers are alive, and what becomes of the run of one that died.

rq learns that a worker died only when its registries are cleaned (every 10 minutes)
and its job's heartbeat has lapsed (a minute and a half): a batch whose worker was
killed showed ``in_progress`` with frozen counts for a quarter of an hour. batchd keeps
its own, shorter, liveness in rq's Redis (``bulk.rq_redis_url``, else the deployment's):

- ``<prefix>:bulk:worker:<name>``: set by each worker every ``interval_s`` with a TTL of
  ``ttl_s`` (JSON: name, rq queue, host, pid, time). The gateway reads these to say
  that no worker would run a batch (:func:`live_workers`).
- ``<prefix>:bulk:running:<rq job id>``: set the same way by the process that runs a job
  (rq's forked work horse, or the worker itself with ``--no-fork``), for as long as it
  runs it. A worker killed alone leaves its horse running, and beating: its run goes on.
- Every ``reap_every_s`` each worker looks at the rq queue's started jobs: one whose
  runner has been silent ``ttl_s`` (and that started longer ago than that) is handed to
  rq's own abandoned-job handling, which requeues it while it has retries left. One
  worker reaps at a time (a lock), so a run is requeued once. Bulk runs and batches are
  resumable, so the next worker continues where the dead one stopped.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timezone
from typing import Any

import orjson
import redis
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from batchd.config.sections import BulkSettings
from batchd.producers.keys import DEFAULT_PREFIX, Keys

log = logging.getLogger(__name__)

SCAN_COUNT = 500
# Redis errors a beat survives (it tries again at its next tick).
BEAT_ERRORS = (redis.RedisError, OSError)


@dataclass(frozen=True)
class Liveness:
    """How a worker says it is alive and finds the runs of dead ones."""

    prefix: str = DEFAULT_PREFIX
    interval_s: float = BulkSettings().heartbeat_interval_s
    ttl_s: float = BulkSettings().heartbeat_ttl_s
    reap_every_s: float = BulkSettings().reap_interval_s
    keys: Keys = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", Keys(self.prefix))

    @classmethod
    def from_settings(cls, bulk: BulkSettings, *, prefix: str) -> Liveness:
        return cls(prefix, bulk.heartbeat_interval_s, bulk.heartbeat_ttl_s, bulk.reap_interval_s)

    def worker_key(self, name: str) -> str:
        return self.keys.bulk_worker(name)

    @property
    def worker_pattern(self) -> str:
        return self.keys.bulk_worker_pattern

    def runner_key(self, job_id: str) -> str:
        return self.keys.bulk_running(job_id)

    @property
    def reap_lock(self) -> str:
        return self.keys.bulk_reaping


def beat_value(**fields: Any) -> bytes:
    return orjson.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "at": time.time(), **fields}
    )


class Beat:
    """A thread setting ``key`` (with a TTL) every interval until :meth:`stop`, which
    deletes it; ``tick`` runs after each beat (the worker's reaper)."""

    def __init__(
        self,
        conn: redis.Redis,
        key: str,
        liveness: Liveness,
        *,
        fields: dict[str, Any],
        tick: Any = None,
    ) -> None:
        self.conn = conn
        self.key = key
        self.liveness = liveness
        self.fields = fields
        self.tick = tick
        self._failing: str | None = None  # the kind of error the last beat met
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"beat {key}", daemon=True)

    def __enter__(self) -> Beat:
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def beat(self) -> None:
        """Set the key once. A beat Redis does not take (unreachable, or an error reply:
        out of memory, an ACL) is warned about once per kind of error, not every beat,
        and said again when a beat is set."""
        ttl_ms = int(self.liveness.ttl_s * 1000)
        try:
            self.conn.set(self.key, beat_value(**self.fields), px=ttl_ms)
        except BEAT_ERRORS as exc:
            if type(exc).__name__ != self._failing:
                log.warning("heartbeat %s not set: %s", self.key, type(exc).__name__)
            self._failing = type(exc).__name__
            return
        if self._failing is not None:
            log.info("heartbeat %s restored", self.key)
        self._failing = None

    def _run(self) -> None:
        while not self._stop.wait(self.liveness.interval_s):
            self.beat()
            if self.tick is not None:
                try:
                    self.tick()
                except BEAT_ERRORS as exc:
                    log.warning("reaping skipped: %s", type(exc).__name__)
                except Exception:
                    log.exception("reaping failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.liveness.interval_s + 5)
        try:
            self.conn.delete(self.key)
        except BEAT_ERRORS:
            pass  # it expires by itself


class Reaper:
    """Requeues the started jobs of an rq queue whose runner is dead (see the module doc);
    :meth:`maybe` does it at most every ``reap_every_s``."""

    def __init__(
        self, conn: redis.Redis, queue_name: str, liveness: Liveness, job_class: type[Job]
    ) -> None:
        self.conn = conn
        self.liveness = liveness
        self.job_class = job_class
        self.registry = StartedJobRegistry(
            queue_name, connection=conn, job_class=job_class, serializer=JSONSerializer
        )
        self._last = -float("inf")

    def maybe(self) -> list[str]:
        if time.monotonic() - self._last < self.liveness.reap_every_s:
            return []
        self._last = time.monotonic()
        return self.reap()

    def dead_entries(self, now: float | None = None) -> list[str]:
        """Registry entries of started jobs whose runner is silent."""
        now = time.time() if now is None else now
        dead = []
        entries: Any = self.conn.zrange(self.registry.key, 0, -1)
        for raw in entries:
            entry = raw.decode() if isinstance(raw, bytes) else str(raw)
            job_id = self.registry.parse_job_id(entry)
            if self.conn.exists(self.liveness.runner_key(job_id)):
                continue
            try:
                job = self.job_class.fetch(job_id, connection=self.conn, serializer=JSONSerializer)
            except Exception:  # gone, or unreadable: rq's own cleanup deals with it
                continue
            started = job.started_at
            if job.get_status() != JobStatus.STARTED or started is None:
                continue
            if now - started.replace(tzinfo=timezone.utc).timestamp() < self.liveness.ttl_s:
                continue  # its runner may not have beaten yet
            dead.append(entry)
        return dead

    def reap(self) -> list[str]:
        """Requeue (through rq: retries counted) every run whose runner died; their ids."""
        dead = self.dead_entries()
        if not dead:
            return []
        token = secrets.token_hex(8).encode()
        lock_ms = int(max(self.liveness.reap_every_s, 5.0) * 1000)
        if not self.conn.set(self.liveness.reap_lock, token, nx=True, px=lock_ms):
            return []  # another worker is at it
        try:
            dead = self.dead_entries()  # again, under the lock
            for entry in dead:
                self.conn.zadd(self.registry.key, {entry: 0}, xx=True)
            # rq's cleanup of entries expired by time 1: exactly those just zeroed.
            self.registry.cleanup(timestamp=1)
        finally:
            if self.conn.get(self.liveness.reap_lock) == token:
                self.conn.delete(self.liveness.reap_lock)
        ids = [self.registry.parse_job_id(e) for e in dead]
        for job_id in ids:
            log.warning("rq job %s: its runner died; requeued for another worker", job_id)
        return ids


def live_workers(conn: redis.Redis, liveness: Liveness, rq_queue: str) -> list[dict[str, Any]]:
    """The live workers of ``rq_queue`` (their heartbeats), read now."""
    keys = list(conn.scan_iter(liveness.worker_pattern, count=SCAN_COUNT))
    values: Any = conn.mget(keys) if keys else []
    return beats_of(values, rq_queue)


def beats_of(values: list[Any], rq_queue: str) -> list[dict[str, Any]]:
    """The worker heartbeats among ``values`` (raw keys) that take jobs from ``rq_queue``."""
    found = []
    for value in values:
        if value is None:
            continue
        try:
            beat = orjson.loads(value)
        except orjson.JSONDecodeError:
            continue
        if isinstance(beat, dict) and rq_queue in (beat.get("queues") or []):
            found.append(beat)
    return found
