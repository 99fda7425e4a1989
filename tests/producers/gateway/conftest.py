"""One redis-server, one real daemon on the tiny model and one gateway per module (and,
for tests that ask, SmolLM2 on a daemon and gateway of its own).

The gateway runs in uvicorn on a thread, on a free port of 127.0.0.1; tests
talk to it with the official ``openai`` package, as any client would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import redis

from batchd.config.sections import GatewaySettings
from batchd.engine.models.gguf_convert import convert_gguf
from batchd.engine.models.registry import packaged_gguf
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving.server import uvicorn_config
from support.asgi import serve_in_thread
from support.daemon_harness import DaemonProcess, daemon_config, wait_heartbeat, wait_until
from support.redis_server import free_port

API_KEY = "sk-test-gateway"


@dataclass
class Gateway:
    url: str
    redis_url: str
    options: GatewayOptions

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@contextmanager
def run_gateway(
    redis_url: str, options: GatewayOptions, server_settings: GatewaySettings | None = None
) -> Iterator[Gateway]:
    """The gateway app in uvicorn on a thread, configured as `batchd gateway` configures
    it (``server_settings``' bounds: header timeout, connection limit...); stopped on exit."""
    port = free_port()
    settings = (server_settings or GatewaySettings()).model_copy(
        update={"host": "127.0.0.1", "port": port}
    )
    config = uvicorn_config(create_app(redis_url, options), settings, log_level="warning")
    with serve_in_thread(config) as url:
        yield Gateway(url, redis_url, options)


AUDIT_GROUP = "audit"


@pytest.fixture(scope="module")
def daemon(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    """``batchd serve`` on the tiny model, its heartbeat live before any test runs."""
    tmp = tmp_path_factory.mktemp("daemon")
    proc = DaemonProcess(
        daemon_config(tmp, redis_url), model=tiny_model, log_path=tmp / "d.log"
    ).wait_serving()
    wait_heartbeat(redis_url)
    client = redis.Redis.from_url(redis_url)
    # An audit group that reads nothing: the daemon's trimming of acked entries keeps every
    # entry past it (batchd.daemon.fleet.housekeeping), so a test can read what the
    # gateway queued after the job has ended (test_gateway_tools.last_job).
    client.xgroup_create("batchd:queue:default", AUDIT_GROUP, id="$", mkstream=True)
    client.close()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def gateway(
    redis_url: str, daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    options = GatewayOptions(
        api_keys=[API_KEY], files_dir=tmp_path_factory.mktemp("files"), batch_window=8
    )
    with run_gateway(redis_url, options) as gw:
        yield gw


@pytest.fixture(scope="module")
def smol(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """SmolLM2-135M-Instruct (its packaged GGUF, float32) on a daemon and gateway of their
    own (queue ``smol``, model ``smollm2``): a real model, which ends on its end token and
    writes CJK text as byte-level pieces."""
    tmp = tmp_path_factory.mktemp("smol")
    model = convert_gguf(packaged_gguf("smollm2"), tmp / "smollm2", keep_quantized=False)
    daemon = DaemonProcess(
        daemon_config(tmp, redis_url),
        model=model,
        log_path=tmp / "d.log",
        env={"BATCHD_QUEUES": '["smol"]'},
    ).wait_serving()
    try:
        options = GatewayOptions(api_keys=[API_KEY], queue="smol", files_dir=tmp)
        with run_gateway(redis_url, options) as gw:
            client = openai.OpenAI(base_url=gw.base_url, api_key=API_KEY, max_retries=0)
            wait_until(lambda: bool(client.models.list().data), what="smol heartbeat")
            client.close()
            yield gw
    finally:
        daemon.kill()


@pytest.fixture
def smol_oai(smol: Gateway) -> Iterator[openai.OpenAI]:
    """The official sync client on :func:`smol`'s gateway."""
    client = openai.OpenAI(base_url=smol.base_url, api_key=API_KEY, max_retries=0)
    yield client
    client.close()


@pytest.fixture
def oai(gateway: Gateway) -> Iterator[openai.OpenAI]:
    """The official sync client on the gateway (no retries: a refusal must show)."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)
    yield client
    client.close()


@pytest.fixture
def aoai(gateway: Gateway) -> openai.AsyncOpenAI:
    """The official async client on the gateway (closed by each test's event loop)."""
    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture
def start_gateway() -> Callable[[str, GatewayOptions], AbstractContextManager[Gateway]]:
    """Another gateway (other options) for one test: ``with start_gateway(url, opts) as gw``."""
    return run_gateway
