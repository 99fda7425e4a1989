"""A Sentinel failover under traffic: the master is SIGKILLed while jobs are submitted
and generated, Sentinel promotes the replica, and the daemon, the producer and the
followers, and a gateway serving OpenAI requests all carry on with the new master without
a restart. Every job completes
exactly once, with a one-run stream (delivered and stored) holding the tokens an
uninterrupted run gives."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from ha_checks import assert_each_job_once, mid_run, uninterrupted

from batchd.config.sections import GatewaySettings
from batchd.producers.client import Client
from batchd.producers.follow import RECONNECT_ERRORS
from batchd.producers.gateway.app import create_app
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving.server import uvicorn_config
from batchd.producers.keys import Keys
from batchd.producers.schema import Event
from support.asgi import serve_in_thread
from support.daemon_harness import (
    DaemonProcess,
    daemon_config,
    wait_until,
)
from support.redis_server import free_port
from support.sentinel import SentinelDeployment, sentinel_deployment

KEYS = Keys()
SUBMIT_EVERY_S = 0.15
KILL_AFTER = 4  # jobs submitted before the master dies
API_KEY = "sk-ha"


def job_request(i: int, prefix: str) -> dict[str, Any]:
    """Job ``i`` of the run: greedy and seeded ones, of a few lengths."""
    request: dict[str, Any] = {
        "id": f"{prefix}{i}",
        "prompt_token_ids": [3 + i, 11, 17 + 2 * i, 5],
        "max_tokens": 64 + 16 * (i % 4),
    }
    if i % 2:
        request.update(temperature=0.8, seed=500 + i)
    return request


class Producer(threading.Thread):
    """Submits the jobs one by one, each retried (idempotent: same id) until Redis takes it,
    and follows each in a thread of its own, recording what it was given."""

    def __init__(self, client: Client, jobs: int) -> None:
        super().__init__(name="producer", daemon=True)
        self.client = client
        self.jobs = jobs
        self.submitted: list[str] = []
        self.retries = 0
        self.delivered: dict[str, list[Event]] = {}
        self.errors: list[str] = []
        self.followers: list[threading.Thread] = []

    def run(self) -> None:
        for i in range(self.jobs):
            request = job_request(i, "ha")
            while True:
                try:
                    self.client.submit_request(request, idempotent=True)
                    break
                except RECONNECT_ERRORS:  # a failover's, a cluster's changing hands
                    self.retries += 1
                    time.sleep(0.1)
            self.submitted.append(request["id"])
            follower = threading.Thread(target=self.follow, args=(request["id"],), daemon=True)
            follower.start()
            self.followers.append(follower)
            time.sleep(SUBMIT_EVERY_S)

    def follow(self, job_id: str) -> None:
        events = self.delivered.setdefault(job_id, [])
        try:
            events.extend(self.client.stream(job_id, timeout=90))
        except Exception as exc:  # recorded: the test fails naming it
            self.errors.append(f"{job_id}: {type(exc).__name__}: {exc}")

    def join_all(self, timeout: float) -> None:
        self.join(timeout)
        deadline = time.monotonic() + timeout
        for follower in self.followers:
            follower.join(max(0.0, deadline - time.monotonic()))
        assert not self.is_alive() and not any(f.is_alive() for f in self.followers)


class GatewayLoad(threading.Thread):
    """OpenAI completions through the gateway, one after another (every other one
    streamed) until told to stop; records each request's outcome and its span."""

    def __init__(self, base_url: str) -> None:
        super().__init__(name="gateway-load", daemon=True)
        self.oai = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
        self.stop = threading.Event()
        self.spans: list[tuple[float, float]] = []
        self.failures: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                text = self.complete(streamed=i % 2 == 1)
                assert text, "an empty completion"
            except Exception as exc:  # recorded: the test fails naming it
                self.failures.append(f"request {i}: {type(exc).__name__}: {exc}")
            self.spans.append((started, time.monotonic()))
            i += 1
        self.oai.close()

    def complete(self, *, streamed: bool) -> str:
        # Greedy on a prompt the tiny model continues for ~1400 tokens: every answer ends
        # at max_tokens (sampled, one may end early at the end token by chance).
        options: dict[str, Any] = {
            "model": "tiny",
            "prompt": "Once",
            "max_tokens": 16,
            "temperature": 0,
        }
        if not streamed:
            reply = self.oai.completions.create(**options)
            assert reply.choices[0].finish_reason == "length"
            return reply.choices[0].text
        chunks = list(self.oai.completions.create(stream=True, **options))
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].text for c in chunks if c.choices)


class _GatewayLog(logging.Handler):
    """The in-process gateway's log while installed, for a failure's message (from INFO:
    the events reader's "resumed" line says whether it came back)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        self._logger = logging.getLogger("batchd.producers.gateway")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def text(self) -> str:
        return "\n".join(self.lines[-40:])

    def __enter__(self) -> None:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


@pytest.mark.parametrize("jobs", [10, pytest.param(40, marks=pytest.mark.slow)])
def test_jobs_across_a_sentinel_failover_complete_once(
    tmp_path: Path, tiny_model: Path, jobs: int
) -> None:
    with sentinel_deployment(tmp_path / "redis", down_after_ms=1000) as deployment:
        daemon = DaemonProcess(
            daemon_config(tmp_path, deployment.url),
            model=tiny_model,
            log_path=tmp_path / "daemon.log",
        )
        try:
            daemon.wait_serving(timeout=90)
            options = GatewayOptions(
                api_keys=[API_KEY], files_dir=tmp_path / "files", redis_retry_s=20
            )
            app = create_app(deployment.url, options)
            settings = GatewaySettings(host="127.0.0.1", port=free_port())
            gateway_log = _GatewayLog()
            with (
                serve_in_thread(uvicorn_config(app, settings, log_level="warning")) as url,
                gateway_log,
            ):
                try:
                    _run_across_failover(deployment, f"{url}/v1", jobs)
                except AssertionError as exc:  # with what the processes said
                    raise AssertionError(
                        f"{exc}\n-- gateway:\n{gateway_log.text()}"
                        f"\n-- daemon:\n{daemon.log_tail()}\n{deployment.log_tails()}"
                    ) from exc
            assert "redis_lost" in daemon.log_path.read_text() or "unreachable" in (
                daemon.log_path.read_text()
            ), "the daemon never saw the master go"
        finally:
            daemon.signal(signal.SIGTERM)
            code = daemon.wait(30)
        assert code == 0, daemon.log_tail()


def _run_across_failover(deployment: SentinelDeployment, gateway_url: str, jobs: int) -> None:
    with Client(deployment.url, block_ms=200, reconnect_timeout_s=60) as client:
        producer = Producer(client, jobs)
        gateway = GatewayLoad(gateway_url)
        producer.start()
        gateway.start()
        wait_until(lambda: len(producer.submitted) >= KILL_AFTER, timeout=30, what="first jobs")
        with deployment.master.client() as old:
            wait_until(
                lambda: bool(mid_run(old, KEYS, producer.submitted)), timeout=30, what="mid-run"
            )
        killed_at = time.monotonic()
        deployment.kill_master()
        producer.join_all(timeout=120)
        gateway.stop.set()
        gateway.join(90)
        assert not producer.errors, producer.errors
        assert not gateway.failures, gateway.failures
        assert any(start < killed_at < end for start, end in gateway.spans), gateway.spans
        job_ids = list(producer.submitted)
        assert len(job_ids) == jobs

        reference = uninterrupted(client, jobs, job_request)
        delivered = {job_id: producer.delivered[job_id] for job_id in job_ids}
        assert_each_job_once(client.redis, KEYS, delivered, reference, queues=[KEYS.queue()])
