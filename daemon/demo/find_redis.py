"""Finding a Redis for ``batchd demo`` on a fresh machine.

In order: the configured Redis if it answers a PING at once; else a private
``redis-server`` in a temp dir on a free port; else (if installed) fakeredis'
TCP server, which lacks Lua, so the daemon runs without claiming dead
daemons' jobs (irrelevant to a one-daemon demo).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from batchd.daemon.redis_server import RedisServer, free_port
from batchd.producers.connection import redis_client

log = logging.getLogger(__name__)


@dataclass
class DemoRedis:
    url: str
    kind: str  # "configured" | "private redis-server" | "fakeredis"
    stop: Callable[[], None]


def _answers(url: str) -> bool:
    client = redis_client(url, socket_connect_timeout=0.3, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _private_redis_server() -> DemoRedis | None:
    workdir = tempfile.TemporaryDirectory(prefix="batchd-demo-redis-")
    try:
        server = RedisServer(Path(workdir.name)).start(timeout_s=5.0)
    except RuntimeError as exc:
        log.info("no private redis-server: %s", exc)
        workdir.cleanup()
        return None

    def stop() -> None:
        server.stop()
        workdir.cleanup()

    return DemoRedis(server.url, "private redis-server", stop)


def _fakeredis_server() -> DemoRedis | None:
    try:
        from fakeredis import TcpFakeServer
    except ImportError:
        return None
    port = free_port()
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
    found = _private_redis_server() or _fakeredis_server()
    if found is None:
        raise RuntimeError(
            f"no Redis at {configured}, no redis-server on PATH and no fakeredis: "
            "install redis-server (bash daemon/demo.sh does it for you)"
        )
    return found
