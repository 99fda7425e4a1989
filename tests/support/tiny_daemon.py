"""A private redis-server and a real ``batchd serve`` subprocess on the tiny model.

For tests that check what a user sees end to end (the README's examples, ``batchd
submit`` through the chat template): the product's own daemon, MLX and all, on a
random-weight model small enough to answer in milliseconds.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from support.daemon_harness import DaemonProcess, daemon_config
from support.redis_server import RedisServer


@contextmanager
def tiny_daemon(
    tmp: Path, model: Path, *, serve_args: Sequence[str] = (), start_timeout: float = 60
) -> Iterator[str]:
    """Yield the Redis URL once the daemon serves ``model`` (the tiny one, or any other);
    stop both on exit (SIGTERM, then the server), failing if the daemon does not stop
    cleanly."""
    server = RedisServer(tmp / "redis").start()
    try:
        daemon = DaemonProcess(
            daemon_config(tmp, server.url),
            model=model,
            log_path=tmp / "daemon.log",
            extra_args=serve_args,
        )
        try:
            daemon.wait_serving(timeout=start_timeout)
        except BaseException:
            daemon.kill()
            raise
        try:
            yield server.url
        finally:
            daemon.signal(signal.SIGTERM)
            code = daemon.wait(30)
        assert code == 0, daemon.log_tail()
    finally:
        server.kill()
