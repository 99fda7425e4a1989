"""Fixtures: private redis-servers, fakeredis, and the tiny model built once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from support.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server (no persistence) for one test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture
def redis_server_aof(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server with AOF (appendfsync always) for durability tests."""
    server = RedisServer(tmp_path / "redis-aof", appendonly=True).start()
    yield server
    server.kill()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def fake_redis() -> Iterator[fakeredis.FakeRedis]:
    """In-process fakeredis for fast logic tests only: fakeredis 2.40 mishandles blocking
    XREADGROUP (returns at once, hides entries), so anything blocking uses redis_server."""
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` llama fixture model, built once per test session."""
    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", FixtureSpec(preset="tiny"))
