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
        self, directory: Path, *, appendonly: bool = False, extra_args: Sequence[str] = ()
    ) -> None:
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
        self.proc: subprocess.Popen[bytes] | None = None

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
        the end of its log if it exits or does not answer within ``timeout_s``."""
        self.directory.mkdir(parents=True, exist_ok=True)
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
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout_s)
        except RuntimeError:
            self.kill()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
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
