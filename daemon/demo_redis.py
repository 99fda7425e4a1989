"""Finding a Redis for ``batchd demo`` on a fresh machine.

In order: the configured Redis if it answers a PING at once; else a private
``redis-server`` in a temp dir on a free port; else (if installed) fakeredis'
TCP server, which lacks Lua, so the daemon runs without claiming dead
daemons' jobs (irrelevant to a one-daemon demo).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

log = logging.getLogger(__name__)


@dataclass
class DemoRedis:
    url: str
    kind: str  # "configured" | "private redis-server" | "fakeredis"
    stop: Callable[[], None]


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.3, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _private_redis_server(binary: str) -> DemoRedis | None:
    workdir = tempfile.TemporaryDirectory(prefix="batchd-demo-redis-")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir.name]
        + ["--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def stop() -> None:
        proc.terminate()
        proc.wait(10)
        workdir.cleanup()

    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and proc.poll() is None:
        if _answers(url):
            return DemoRedis(url, "private redis-server", stop)
        time.sleep(0.05)
    stop()
    return None


def _fakeredis_server() -> DemoRedis | None:
    try:
        from fakeredis import TcpFakeServer
    except ImportError:
        return None
    port = _free_port()
    server = TcpFakeServer(("127.0.0.1", port))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return DemoRedis(f"redis://127.0.0.1:{port}/0", "fakeredis", stop)


def find_redis(configured: str) -> DemoRedis:
    """A reachable Redis for the demo; raises RuntimeError when there is none."""
    if _answers(configured):
        return DemoRedis(configured, "configured", lambda: None)
    binary = shutil.which("redis-server")
    found = _private_redis_server(binary) if binary else None
    found = found or _fakeredis_server()
    if found is None:
        raise RuntimeError(
            f"no Redis at {configured}, no redis-server on PATH and no fakeredis: "
            "install redis-server (bash daemon/demo.sh does it for you)"
        )
    return found
