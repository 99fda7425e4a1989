"""The heartbeat: a key with a TTL saying "this daemon is alive", and what it is doing.

It runs on its own thread and its own Redis connection, so neither a blocking
XREADGROUP nor a long engine step can starve it (no MLX here: the engine
thread publishes a snapshot dict, this thread only reads it). Other daemons
claim this one's jobs only once the key has expired. After each beat the thread also
reads the daemon's control hash (pause, drain: batchd.daemon.fleet.controls), so an
operator's request costs one command a beat, never one a step.

The key is owned: its body names this process's ``instance`` (host, pid, a
random tag), and it is set, refreshed or deleted only by a script that checks
that owner atomically. A second daemon started under the same consumer name
cannot take the key while the first refreshes it, so it refuses to start
instead of running the first one's jobs a second time; and the first one's
graceful stop never deletes another process's key.

With each beat the thread also keeps the deployment's key layout stored (one GET a
beat: batchd.producers.connection.layout.LayoutClaim): a layout lost while daemons run
(a Redis restarted without persistence, a FLUSHALL, an eviction under an allkeys-*
policy) is written again within a beat, with a warning, so that clients started since
read the partitions in force. Another layout found stored means the deployment was laid
out anew under this daemon: it logs an error and the loop stops intake, lets the jobs it
holds finish (theirs is the old layout) and exits with LayoutMismatch
(:attr:`Heartbeat.layout_error`), rather than keep reading names no new client writes.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

import orjson
import redis

from batchd import __version__
from batchd.config.settings import Settings
from batchd.daemon.fleet.controls import CONTROLS, ControlWatch
from batchd.producers.connection.layout import LayoutClaim, LayoutMismatch, LayoutNotWritable
from batchd.producers.keys import Keys
from batchd.producers.schema import DaemonHeartbeat

log = logging.getLogger(__name__)

# Exit status of a daemon whose engine stalled (EX_SOFTWARE).
EXIT_STALLED = 70

# KEYS[1] heartbeat key; ARGV[1] this instance, ARGV[2] body, ARGV[3] ttl ms.
# Sets the key when it is absent or ours; returns the holder's body otherwise.
_SET = """
local held = redis.call('GET', KEYS[1])
if held and cjson.decode(held)['instance'] ~= ARGV[1] then return held end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return false
"""

# KEYS[1] heartbeat key; ARGV[1] this instance. Deletes the key only when it is ours.
_DELETE = """
local held = redis.call('GET', KEYS[1])
if held and cjson.decode(held)['instance'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class ConsumerTaken(RuntimeError):
    """Another live process holds this consumer name's heartbeat."""

    def __init__(self, key: str, holder: dict[str, Any]) -> None:
        self.key = key
        self.holder = holder
        super().__init__(
            f"consumer {holder.get('consumer')!r} is already served by "
            f"{holder.get('host')} pid {holder.get('pid')} (heartbeat {key} is live); "
            "give this daemon another --consumer-name"
        )


class Heartbeat:
    """``<prefix>:daemon:<consumer>`` set to a JSON body with a TTL, every interval."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        *,
        interval_s: float,
        ttl_s: float,
        info: dict[str, Any],
        stall_timeout_s: float = float("inf"),
        watch: ControlWatch | None = None,
        layout: LayoutClaim | None = None,
    ) -> None:
        """``watch``: the control hash read after each beat (and once at :meth:`acquire`,
        before the daemon reads any job); ``layout``: the layout kept stored after each
        beat (claimed by the daemon before :meth:`acquire`)."""
        self.redis = client
        self.watch = watch
        self.layout = layout
        # Set (once) by the thread when another layout is stored: the loop stops on it.
        self.layout_error: LayoutMismatch | None = None
        self.key = key
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        host, pid = socket.gethostname(), os.getpid()
        self.instance = f"{host}:{pid}:{secrets.token_hex(4)}"
        self.static = {
            **info,
            "instance": self.instance,
            "pid": pid,
            "host": host,
            "started_at": time.time(),
        }
        self.snapshot: dict[str, Any] = {}
        # Liveness is progress: ``busy`` with ``last_step_at`` older than this is a stall,
        # and the process exits (see _exit_stalled).
        self.stall_timeout_s = stall_timeout_s
        self._set = client.register_script(_SET)
        self._delete = client.register_script(_DELETE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchd-heartbeat", daemon=True)
        self._failing: str | None = None

    def update(self, **figures: Any) -> None:
        """Replace the live figures (called from the engine thread; a dict swap is atomic)."""
        self.snapshot = figures

    def beat(self) -> None:
        """Set the key once now; raises ConsumerTaken when another process holds it,
        and Redis errors as they come."""
        body = DaemonHeartbeat.model_validate({**self.static, **self.snapshot, "at": time.time()})
        payload = body.model_dump_json().encode()
        held = self._set(keys=[self.key], args=[self.instance, payload, self.ttl_ms])
        if held:
            raise ConsumerTaken(self.key, orjson.loads(held))

    def acquire(self) -> None:
        """Take the key at start. A key left by a crashed process with the same name
        expires within a TTL, so a holder is waited for that long (plus an interval)
        before ConsumerTaken says it is alive."""
        deadline = time.monotonic() + self.ttl_s + self.interval_s
        while True:
            try:
                self.beat()
                if self.watch is not None:
                    self.watch.read()
                return
            except ConsumerTaken:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(self.interval_s, 0.5))

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, remove: bool) -> None:
        """Stop beating; ``remove`` deletes the key (if still ours) so other daemons
        may claim at once."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if remove:
            self.remove()

    def remove(self) -> None:
        """Delete the key if it is still this process's (other daemons may claim at once)."""
        try:
            self._delete(keys=[self.key], args=[self.instance])
        except redis.RedisError as exc:
            log.warning("could not delete heartbeat %s: %s", self.key, exc)

    def stalled_for(self) -> float:
        """Seconds the engine has had work without completing a step (0 when fine)."""
        figures = self.snapshot
        if not figures.get("busy"):
            return 0.0
        silent = time.time() - float(figures.get("last_step_at") or time.time())
        return silent if silent > self.stall_timeout_s else 0.0

    def _run(self) -> None:
        # Every error is survived: a daemon whose heartbeat thread died would see its
        # live jobs claimed by others.
        while not self._stop.is_set():
            try:
                self.beat()
                if self.watch is not None:
                    self.watch.read()
                self.keep_layout()
                if self._failing:
                    log.info("heartbeat %s restored", self.key)
                self._failing = None
            except (redis.RedisError, ConsumerTaken, LayoutNotWritable) as exc:
                if str(exc) != self._failing:
                    log.error("heartbeat %s failed: %s", self.key, exc)
                self._failing = str(exc)
            stalled = self.stalled_for()
            if stalled:
                self._exit_stalled(stalled)
            self._stop.wait(self.interval_s)

    def keep_layout(self) -> None:
        """Store the layout again if it was lost; another one stored sets
        :attr:`layout_error` (and is not checked again). Raises Redis errors and
        LayoutNotWritable (the user may not store the lost layout) as they come."""
        if self.layout is None or self.layout_error is not None:
            return
        try:
            if self.layout.reassert(self.redis):
                log.warning(
                    "the key layout %s was lost (Redis restarted without persistence, "
                    "flushed, or evicted it): stored it again (%d partition(s))",
                    self.layout.key,
                    self.layout.partitions,
                    extra={"event": "layout_restored"},
                )
        except LayoutMismatch as exc:
            log.error(
                "another key layout was stored under this daemon: %s; stopping intake, the "
                "jobs held finish, then this daemon exits",
                exc,
                extra={"event": "layout_changed"},
            )
            self.layout_error = exc

    def check_layout(self) -> None:
        """Raise the LayoutMismatch found while running, if any (the daemon then exits 2,
        as it would at a start under that layout)."""
        if self.layout_error is not None:
            raise self.layout_error

    def _exit_stalled(self, silent_s: float) -> None:
        """The engine has had work and no completed step for ``stall_timeout_s``: the
        engine thread cannot be interrupted, so the process leaves its jobs to others
        (their events are the checkpoint) and exits non-zero for its supervisor to
        restart it."""
        log.critical(
            "engine stalled: work and no completed step for %.0fs; exiting (status %d) so "
            "that other daemons take over the jobs",
            silent_s,
            EXIT_STALLED,
        )
        self.remove()
        logging.shutdown()
        os._exit(EXIT_STALLED)


def daemon_heartbeat(
    settings: Settings,
    watch: ControlWatch,
    consumer: str,
    max_model_len: int | None,
    layout: LayoutClaim | None = None,
) -> Heartbeat:
    """The heartbeat of a daemon serving ``settings``' queues as ``consumer``: what it
    serves (model, queues, context bound, version), the controls it obeys, read by
    ``watch`` after each beat on the watch's connection, and the ``layout`` it keeps
    stored."""
    keys, opts = Keys(settings.key_prefix), settings.daemon
    return Heartbeat(
        watch.redis,
        keys.daemon(consumer),
        interval_s=opts.heartbeat_interval_s,
        ttl_s=opts.heartbeat_ttl_s,
        info={
            "consumer": consumer,
            "model": settings.model,
            "queues": list(settings.queues),
            "version": __version__,
            "max_model_len": max_model_len,
            "adapters": sorted(settings.engine.adapters),
            "controls": list(CONTROLS),
        },
        stall_timeout_s=opts.stall_timeout_s,
        watch=watch,
        layout=layout,
    )
