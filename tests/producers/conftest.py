"""Fixtures shared by the gateway's and the dashboard's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server for one test module (its daemon and server share it)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.kill()
