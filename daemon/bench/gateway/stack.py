"""The processes behind the gateway workload: redis-server, a daemon and a gateway.

Each runs as its own process, as in production, so the figures are the gateway's own and
not a client sharing its event loop. Redis keeps an AOF, so stopping and starting it
(``GatewayStack.redis``, on the same port) keeps the fleet's state the way a production
restart does. Everything listens on 127.0.0.1, on free ports.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from batchd.daemon.bench.gateway.http_load import request
from batchd.daemon.redis_server import RedisServer, free_port
from batchd.engine.cache import HOME_ENV

# The daemon's engine: enough sequences that short requests do not queue behind the
# gateway, a pool that never preempts them.
ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "num_kv_blocks": 4096}
# The daemon settings the figures were measured with. The heartbeat is production's
# (its default TTL outlives a short Redis restart, so the gateway keeps seeing the
# fleet); reconnects back off at most this long, so the daemon is back soon after Redis.
DAEMON = {
    "heartbeat_interval_s": 1.0,
    "heartbeat_ttl_s": 10.0,
    "claim_interval_s": 0.1,
    "block_ms": 100,
    "grace_period_s": 5.0,
    "redis_retry_max_s": 0.2,
}
# Connection ceilings far above the scenarios' sizes, so the gateway's own limits never
# answer 503 for a request the bench sent on purpose.
GATEWAY_LIMITS = ("--max-in-flight", "4096", "--max-backlog", "4096")


class StackFailed(RuntimeError):
    """A process of the stack exited or never became ready; the message ends with the
    tail of every process's log."""


class GatewayStack:
    """redis-server (AOF), ``batchd serve`` on ``model`` and ``batchd gateway``.

    Use as a context manager: entering starts all three and waits until the gateway sees
    the daemon; leaving stops them. ``workdir`` holds Redis's files and the logs.
    """

    def __init__(self, workdir: Path, *, model: str, start_timeout_s: float = 300.0) -> None:
        self.workdir = workdir
        self.model = model
        self.start_timeout_s = start_timeout_s
        self.redis = RedisServer(workdir / "redis", appendonly=True)
        self.port = free_port()
        self.model_name = ""  # what the gateway calls the model, read once it is live
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> GatewayStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start Redis, the daemon and the gateway; StackFailed if one exits or the
        gateway does not see the daemon within ``start_timeout_s`` (a preset model is
        built into the model cache on first use, which takes part of that time)."""
        self.redis.start()
        self._spawn("daemon", "serve", "--model", self.model)
        self._spawn("gateway", "gateway", "--port", str(self.port), *GATEWAY_LIMITS)
        self.model_name = asyncio.run(self._wait_live())

    def _environment(self) -> dict[str, str]:
        """The settings of both processes, as batchd reads them (BATCHD_* variables).
        The caller's own BATCHD_* variables (a config file, API keys) are left out so that
        they cannot change the measurement, all but BATCHD_HOME: where the model is."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_") or k == HOME_ENV}
        env["BATCHD_REDIS_URL"] = self.redis.url
        env["BATCHD_LOG_LEVEL"] = "WARNING"
        env["BATCHD_DAEMON"] = orjson.dumps(DAEMON).decode()
        env["BATCHD_ENGINE"] = orjson.dumps(ENGINE).decode()
        return env

    def _spawn(self, name: str, *args: str) -> None:
        command = [sys.executable, "-m", "batchd.daemon.cli", *args]
        with (self.workdir / f"{name}.log").open("wb") as log:
            self.procs.append(
                subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._environment(),
                    cwd=self.workdir,
                )
            )

    async def _wait_live(self) -> str:
        """Poll /health until the gateway sees a daemon; the model's name from /v1/models."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise StackFailed("a process of the stack exited at start:\n" + self.logs())
            health = await request(self.port, "/health", method="GET", timeout_s=2)
            if health.status == 200 and orjson.loads(health.body).get("daemons"):
                models = await request(self.port, "/v1/models", method="GET", timeout_s=2)
                if models.status == 200:
                    name: str = orjson.loads(models.body)["data"][0]["id"]
                    return name
            await asyncio.sleep(0.2)
        raise StackFailed(
            f"no live daemon seen by the gateway after {self.start_timeout_s:.0f}s:\n" + self.logs()
        )

    def logs(self) -> str:
        """The end of every process's log, for an error message."""
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.workdir.glob("*.log"))
        )

    def stop(self) -> None:
        """SIGTERM the daemon and the gateway (SIGKILL after 30 s), then kill Redis."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs.clear()
        self.redis.kill()
