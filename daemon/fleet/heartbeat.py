"""The heartbeat: a key with a TTL saying "this daemon is alive", and what it is doing.

It runs on its own thread and its own Redis connection, so neither a blocking
XREADGROUP nor a long engine step can starve it (no MLX here: the engine
thread publishes a snapshot dict, this thread only reads it). Other daemons
claim this one's jobs only once the key has expired.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import orjson
import redis

from daemon.worker.redis_io import REDIS_DOWN

log = logging.getLogger(__name__)


class Heartbeat:
    """``SET <prefix>:daemon:<consumer> <JSON> PX <ttl>`` every interval until stopped."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        *,
        interval_s: float,
        ttl_s: float,
        info: dict[str, Any],
    ) -> None:
        self.redis = client
        self.key = key
        self.interval_s = interval_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.static = {
            **info,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
        }
        self.snapshot: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchd-heartbeat", daemon=True)
        self._failing = False

    def update(self, **figures: Any) -> None:
        """Replace the live figures (called from the engine thread; a dict swap is atomic)."""
        self.snapshot = figures

    def beat(self) -> None:
        """Set the key once now (raises on Redis errors)."""
        body = {**self.static, **self.snapshot, "at": time.time()}
        self.redis.set(self.key, orjson.dumps(body), px=self.ttl_ms)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, remove: bool) -> None:
        """Stop beating; ``remove`` deletes the key so other daemons may claim at once."""
        self._stop.set()
        self._thread.join(timeout=5)
        if remove:
            try:
                self.redis.delete(self.key)
            except REDIS_DOWN as exc:
                log.warning("could not delete heartbeat %s: %s", self.key, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
                if self._failing:
                    log.info("heartbeat %s restored", self.key)
                self._failing = False
            except REDIS_DOWN as exc:
                if not self._failing:
                    log.warning("heartbeat %s failed: %s", self.key, exc)
                self._failing = True
            self._stop.wait(self.interval_s)
