"""Disconnects cancel jobs; keys, body size, jobs in flight and the queue's backlog are
bounded; Redis trouble is a 503 that never shows the Redis URL."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.schema import JobState, JobStatus
from support.redis_server import free_port

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": "Once", "max_tokens": 2000, "temperature": 0}
API_KEY = "sk-test-gateway"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def wait_state(redis_url: str, job_id: str, state: JobState, timeout: float = 20) -> None:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw: Any = client.hgetall(f"batchd:job:{job_id}")
        if raw and JobStatus.from_hash(raw).state is state:
            return
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} not {state.value} within {timeout}s")


def test_client_leaving_a_stream_cancels_the_job(gateway: Any) -> None:
    body = {**LONG, "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/completions", json=body, headers=AUTH) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    job_id = orjson.loads(first[6:])["id"].removeprefix("cmpl-")
    wait_state(gateway.redis_url, job_id, JobState.cancelled)


def test_client_leaving_a_whole_request_cancels_the_job(gateway: Any) -> None:
    client = redis.Redis.from_url(gateway.redis_url)
    before = set(client.scan_iter("batchd:job:*"))
    # The tiny model writes LONG's ~1400 tokens in ~0.9 s on 2 cores: leave well before.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.base_url}/completions", json=LONG, headers=AUTH, timeout=0.25)
    new = [k.decode() for k in set(client.scan_iter("batchd:job:*")) - before if k.count(b":") == 2]
    assert len(new) == 1
    wait_state(gateway.redis_url, new[0].split(":")[2], JobState.cancelled)


def test_jobs_in_flight_per_key_and_backlog_bounds(
    gateway: Any, tmp_path: Any, start_gateway: Any
) -> None:
    options = GatewayOptions(api_keys=[API_KEY], files_dir=tmp_path, max_in_flight_per_key=1)
    with start_gateway(gateway.redis_url, options) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=API_KEY, max_retries=0)
        stream = client.completions.create(**LONG, stream=True)
        job_id = next(iter(stream)).id.removeprefix("cmpl-")
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert caught.value.response.headers["retry-after"] == "1"
        stream.close()  # the openai SDK leaving a stream: the job is cancelled, the slot free
        wait_state(gateway.redis_url, job_id, JobState.cancelled)
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
    options = GatewayOptions(api_keys=[API_KEY], files_dir=tmp_path, max_backlog=0)
    with start_gateway(gateway.redis_url, options) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert caught.value.code == "queue_full"


def test_body_limit_is_413(gateway: Any, tmp_path: Any, start_gateway: Any) -> None:
    options = GatewayOptions(files_dir=tmp_path, max_body_bytes=1000)
    with start_gateway(gateway.redis_url, options) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt="x" * 2000, max_tokens=1)
        assert caught.value.status_code == 413


def test_redis_down_is_503_without_the_url(tmp_path: Any, start_gateway: Any) -> None:
    url = f"redis://:hunter2secret@127.0.0.1:{free_port()}/0"
    with start_gateway(url, GatewayOptions(files_dir=tmp_path)) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert caught.value.status_code == 503
        assert "hunter2" not in caught.value.response.text
        for listing in (client.files.list, client.batches.list):  # the per-key indexes
            with pytest.raises(openai.APIStatusError) as caught:
                listing()
            assert caught.value.status_code == 503, listing
            assert "hunter2" not in caught.value.response.text
        health = httpx.get(f"{gw.url}/health")
        assert health.status_code == 503 and "hunter2" not in health.text
