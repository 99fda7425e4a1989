"""A private redis-server per test: free port, temp dir, optional AOF.

Tests never touch a Redis that may already run on 6379. The server can be
stopped, killed and restarted on the same port and directory, which the
durability tests use to restart Redis in the middle of a run.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process bound to 127.0.0.1 on a free port."""

    def __init__(self, directory: Path, *, appendonly: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not on PATH; run bash tests/run.sh to install it")
        self.binary = binary
        self.directory = directory
        self.appendonly = appendonly
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def start(self) -> RedisServer:
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
            str(self.directory / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server exited at start:\n{log}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"redis-server on port {self.port} not ready after {timeout}s")

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM): AOF is flushed."""
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
