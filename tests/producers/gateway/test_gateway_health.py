"""``/health/ready`` tells the truth about the fleet; ``/metrics`` counts what was served."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from batchd.producers.gateway.options import GatewayOptions
from support.daemon_harness import DaemonProcess, daemon_config

QUEUE = "elsewhere"


def ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health/ready", timeout=5)


def test_ready_fails_with_no_daemon_and_passes_with_one(
    redis_url: str, tiny_model: Path, tmp_path: Path, start_gateway: Any
) -> None:
    options = GatewayOptions(queue=QUEUE, files_dir=tmp_path / "files")
    with start_gateway(redis_url, options) as gw:
        answer = ready(gw.url)
        assert answer.status_code == 503
        body = answer.json()
        assert body["status"] == "unavailable" and body["redis"] is True
        assert body["missing"] == ["daemon"] and QUEUE in body["message"]
        assert httpx.get(f"{gw.url}/health").status_code == 503  # the same answer
        assert httpx.get(f"{gw.url}/health/live").status_code == 200  # the process is fine

        config = daemon_config(tmp_path, redis_url)
        config.write_text(
            config.read_text().replace('queues = ["default"]', f'queues = ["{QUEUE}"]')
        )
        daemon = DaemonProcess(config, model=tiny_model, log_path=tmp_path / "d.log")
        try:
            daemon.wait_serving()
            deadline = time.monotonic() + 10
            while ready(gw.url).status_code != 200:
                assert time.monotonic() < deadline, ready(gw.url).json()
                time.sleep(0.1)
            body = ready(gw.url).json()
            assert body["daemons"] == 1 and body["models"] == ["tiny"] and "missing" not in body
        finally:
            daemon.kill()
        deadline = time.monotonic() + 10  # its heartbeat lapses (0.5 s in the tests)
        while ready(gw.url).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_metrics_count_requests_and_time_first_tokens(gateway: Any, oai: openai.OpenAI) -> None:
    list(
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
        )
    )
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    text = httpx.get(f"{gateway.url}/metrics").text
    assert (
        'batchd_gateway_requests_total{method="POST",route="/v1/chat/completions",status="200"}'
        in text
    )
    assert 'route="/v1/chat/completions",status="400"' in text
    count = next(
        line
        for line in text.splitlines()
        if line.startswith("batchd_gateway_time_to_first_token_seconds_count")
    )
    assert float(count.split()[-1]) >= 1
    assert "batchd_gateway_request_duration_seconds_bucket" in text
    assert "batchd_gateway_requests_in_flight" in text and "batchd_gateway_jobs_followed" in text
