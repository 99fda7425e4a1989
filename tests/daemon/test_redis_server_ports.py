"""The test deployments' redis-server: a port taken between being chosen and used.

A free port is only free when asked: another process (a client's ephemeral port, another
worker's server) can take it before redis-server binds it, most often a cluster node's
bus port. At its first start a server chooses again; once it has run, its ports are
part of what it is (a restart on the same port, a cluster's map), so it does not.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchd.daemon.redis_server import PortTaken, RedisServer


@contextmanager
def listening(port: int) -> Iterator[None]:
    """Hold ``port`` on 127.0.0.1 as another process would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


@pytest.mark.parametrize("which", ["port", "bus_port"])
def test_a_port_taken_before_the_first_start_is_chosen_again(tmp_path: Path, which: str) -> None:
    server = RedisServer(
        tmp_path / "node", cluster_bus=True, extra_args=["--cluster-enabled", "yes"]
    )
    taken = getattr(server, which)
    with listening(taken):
        server.start()
    try:
        assert getattr(server, which) != taken
        client = server.client()
        info = client.info("server")
        client.close()
        assert int(info["tcp_port"]) == server.port
    finally:
        server.kill()


def test_a_restart_keeps_its_port_and_says_when_it_is_taken(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    port = server.port
    server.kill()
    with listening(port), pytest.raises(PortTaken, match="Address already in use"):
        server.start(timeout_s=5)
    assert server.port == port
