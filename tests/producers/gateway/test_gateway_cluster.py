"""The gateway on a real Redis Cluster, in front of a real daemon (``batchd serve`` on the
tiny model, ``queue.partitions = 3``): an OpenAI completion, whole and streamed, goes
through a partition of the queue and back through the hub, as on a single Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from batchd.daemon.cluster_server import ClusterDeployment
from batchd.producers.client import Client
from batchd.producers.gateway.options import GatewayOptions
from support.daemon_harness import ENGINE_OPTS, DaemonProcess, fast_settings, write_config
from support.partitions import PARTITIONS

MODEL = "tiny"
API_KEY = "sk-test-cluster"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(
    module_cluster: ClusterDeployment, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A daemon of 3 partitions on the cluster, its heartbeat live; the cluster's URL."""
    tmp = tmp_path_factory.mktemp("daemon")
    settings = fast_settings(module_cluster.url)
    for key, value in ENGINE_OPTS.items():
        setattr(settings.engine, key, value)
    settings.queue.partitions = PARTITIONS
    settings.log_level = "INFO"
    config = write_config(tmp / "batchd.toml", settings)
    proc = DaemonProcess(config, model=tiny_model, log_path=tmp / "d.log").wait_serving()
    try:
        admin = module_cluster.client()
        deadline = time.monotonic() + 20
        while not list(admin.scan_iter(match="batchd:daemon:*")):
            assert time.monotonic() < deadline, f"no heartbeat; log:\n{proc.log_tail()}"
            time.sleep(0.05)
        admin.close()
        yield module_cluster.url
    finally:
        proc.kill()


def test_a_completion_whole_and_streamed_through_the_cluster(
    served: str,
    start_gateway: Callable[[str, GatewayOptions], AbstractContextManager[Any]],
    tmp_path: Path,
) -> None:
    options = GatewayOptions(api_keys=[API_KEY], files_dir=tmp_path)
    with start_gateway(served, options) as gateway:
        oai = openai.OpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)
        try:
            whole = oai.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=8, temperature=0
            )
            chunks = list(
                oai.chat.completions.create(
                    model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True
                )
            )
        finally:
            oai.close()
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    with Client(served) as client:  # the same job straight from the client
        direct = client.submit(messages=HELLO, max_tokens=8, temperature=0.0)
        assert direct.result(timeout=60).text == whole.choices[0].message.content


def test_the_batch_api_without_an_rq_redis_is_refused_on_a_cluster(
    served: str,
    start_gateway: Callable[[str, GatewayOptions], AbstractContextManager[Any]],
    tmp_path: Path,
) -> None:
    """rq cannot run on a cluster: a batch created there would wait for a worker forever,
    so without bulk.rq_redis_url the create is refused, saying what to set."""
    options = GatewayOptions(api_keys=[API_KEY], files_dir=tmp_path)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": HELLO, "max_tokens": 4},
    }
    (tmp_path / "in.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    with start_gateway(served, options) as gateway:
        oai = openai.OpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0)
        try:
            with (tmp_path / "in.jsonl").open("rb") as source:
                upload = oai.files.create(file=source, purpose="batch")
            with pytest.raises(openai.InternalServerError) as refused:
                oai.batches.create(
                    input_file_id=upload.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
        finally:
            oai.close()
    assert refused.value.status_code == 503
    assert "bulk.rq_redis_url" in str(refused.value)
