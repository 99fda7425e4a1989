"""A private redis-server: free port, its own directory, optional AOF.

``batchd demo`` starts one when no Redis is configured, and the tests start
one per test, so neither touches a Redis that may already run on 6379. The
server can be stopped, killed and restarted on the same port and directory,
which the durability tests use to restart Redis in the middle of a run.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

PORT_TRIES = 5


class PortTaken(RuntimeError):
    """redis-server could not listen on a port chosen free: something took it since."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process bound to 127.0.0.1 on a free port.

    ``appendonly`` turns on the AOF with ``appendfsync always``, so a SIGKILL
    (:meth:`kill`) loses nothing that was acknowledged. RDB snapshots are off.
    Raises RuntimeError when no redis-server is on PATH.
    """

    def __init__(
        self,
        directory: Path,
        *,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
        cluster_bus: bool = False,
    ) -> None:
        """``cluster_bus``: a Redis Cluster node, whose bus port is chosen free too (the
        default, port + 10000, may be taken or past 65535)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server not on PATH: install Redis "
                "(bash tests/run.sh and bash daemon/demo.sh do it for you)"
            )
        self.binary = binary
        self.directory = directory
        self.appendonly = appendonly
        # More redis-server options (TLS, ACL files), after the defaults so they win.
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.bus_port = free_port() if cluster_bus else None
        self.proc: subprocess.Popen[bytes] | None = None
        # Once it has run, its ports are part of what it is (a restart, a cluster's map).
        self._ran = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def start(self, *, timeout_s: float = 10.0) -> RedisServer:
        """Start the process and wait until it answers PING; raises RuntimeError with
        the end of its log if it exits or does not answer within ``timeout_s``. At its
        first start a port taken since it was chosen (a free port is only free when
        asked) is chosen again, up to :data:`PORT_TRIES` times."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self._launch(timeout_s)
                break
            except PortTaken:
                if self._ran or attempt == PORT_TRIES:
                    raise
                self.log_path.unlink(missing_ok=True)  # the next attempt's log only
                self.port = free_port()
                if self.bus_port is not None:
                    self.bus_port = free_port()
                    # The node's cluster config of the failed attempt names its old ports.
                    (self.directory / "nodes.conf").unlink(missing_ok=True)
        self._ran = True
        return self

    def _launch(self, timeout_s: float) -> None:
        bus = [] if self.bus_port is None else ["--cluster-port", str(self.bus_port)]
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always" if self.appendonly else "everysec",
            "--logfile",
            str(self.log_path),
            *bus,
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout_s)
        except RuntimeError as exc:
            self.kill()
            if "Address already in use" in str(exc):
                raise PortTaken(str(exc)) from None
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # No retry of its own and a read timeout: what answers may be another listener.
        client = redis.Redis(
            port=self.port,
            socket_connect_timeout=0.2,
            socket_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(
            f"redis-server on port {self.port} not ready after {timeout_s}s:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM): the AOF is flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: what survives is what the AOF already holds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
