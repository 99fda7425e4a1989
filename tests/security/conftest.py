"""The edges, for real: one redis-server, the real daemon over predictable text, and
gateways (two API keys, or none) in uvicorn on threads, per module. The daemon serves
the model ``text-model`` (its heartbeat says so), so the gateway and the batch runner
resolve it as they would a real one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.keys import Keys
from batchd.producers.schema import DaemonHeartbeat
from support.edge import KEY_A, KEY_B, MODEL, Edge, edge
from support.redis_server import RedisServer

if TYPE_CHECKING:
    from support.text_daemon import TextGenerator


@pytest.fixture(scope="module")
def edge_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def edge_daemon(edge_redis: RedisServer) -> Iterator[TextGenerator]:
    """The real Worker over predictable text (token i of a job is character i of its
    prompt), serving ``text-model``."""
    # Imported here: only the tests that use the daemon load the daemon's modules.
    from support.daemon_harness import fast_settings, worker_thread
    from support.text_daemon import TextGenerator

    engine = TextGenerator(token_delay_s=0.002)  # a 4,000-token job runs for seconds
    settings = fast_settings(edge_redis.url)
    settings.model = MODEL
    with worker_thread(settings, lambda: engine):
        yield engine


@pytest.fixture(scope="module")
def keyed(
    edge_redis: RedisServer, edge_daemon: TextGenerator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Edge]:
    """A gateway with two keys, A and B."""
    options = GatewayOptions(
        api_keys=[KEY_A, KEY_B], files_dir=tmp_path_factory.mktemp("files"), batch_window=8
    )
    with edge(edge_redis.url, options) as gw:
        yield gw


@pytest.fixture(scope="module")
def listed_model(edge_redis: RedisServer) -> Iterator[str]:
    """A daemon heartbeat naming ``text-model`` at a local path, with no daemon behind
    it: the gateway resolves the model (its checks run), but no job would ever run."""
    beat = DaemonHeartbeat(
        consumer="listed",
        model=f"/srv/models/{MODEL}",
        queues=["default"],
        instance="host:1:listed",
        pid=1,
        host="host",
        started_at=time.time(),
        at=time.time(),
    )
    conn = edge_redis.client()
    conn.set(Keys().daemon("listed"), beat.model_dump_json())
    yield MODEL
    conn.delete(Keys().daemon("listed"))
    conn.close()


@pytest.fixture(scope="module")
def keyless(
    edge_redis: RedisServer, listed_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Edge]:
    """A gateway with no keys (everything shared, as on 127.0.0.1), on a listed model."""
    options = GatewayOptions(files_dir=tmp_path_factory.mktemp("files-open"), batch_window=8)
    with edge(edge_redis.url, options) as gw:
        yield gw
