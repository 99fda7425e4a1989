"""Fixtures: private redis-servers, fakeredis, and the tiny model built once."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from support.redis_server import RedisServer

# MLX's CUDA backend computes float32 products in TF32 (10-bit mantissas) unless told
# otherwise, read once at its first product: the float32 parity tests compare float32
# arithmetic with mlx-lm's, token for token, so they ask for float32 (no effect on a CPU).
os.environ.setdefault("MLX_ENABLE_TF32", "0")


@pytest.fixture(autouse=True)
def _root_logging_as_found() -> Iterator[None]:
    """Give the root logger back as the test found it. A test that runs the CLI in-process
    (``main([...])``) has configure_logging point a root handler at the sys.stderr of that
    moment, pytest's capture of that test, closed when the test ends: every log line of a
    later test (its daemon threads') then failed with ``--- Logging error ---``. pytest's
    own handlers come and go with each phase and are left to it."""
    root = logging.getLogger()
    found, level = _own_handlers(root), root.level
    yield
    for handler in _own_handlers(root):
        if handler not in found:
            root.removeHandler(handler)
            handler.close()
    for handler in found:
        root.addHandler(handler)  # again where a test's basicConfig(force=True) dropped it
    root.setLevel(level)


def _own_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """``logger``'s handlers other than pytest's log capture."""
    return [h for h in logger.handlers if not type(h).__module__.startswith("_pytest")]


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
