"""Scenario 6: connection errors while submitting and following. A connection error
is a connection error (the CLI exits 3), never "already submitted"; a submit whose
reply was lost is recognised as done; following a job that does not exist ends with
JobNotFound after a bounded wait instead of waiting forever."""

from __future__ import annotations

import time

import pytest
import redis

from batchd.daemon.chaos.proxy import proxy_to
from batchd.daemon.cli import main as cli_main
from batchd.producers.client import Client
from batchd.producers.errors import JobNotFound
from faults.checks import KEYS
from support.redis_server import RedisServer, free_port


def test_connection_errors_surface_as_such_and_a_retry_is_safe(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    with proxy_to(redis_server.port) as proxy:
        producer = Client(proxy.url)
        producer.submit("warm up", id="warm")
        proxy.lose_next_reply()  # the submit runs in Redis; its reply never arrives
        try:
            handle = producer.submit("hello", id="lost-reply", max_tokens=3)
        except redis.ConnectionError:
            # Surfaced (no automatic retry): the job is there; attaching is safe.
            handle = producer.submit("hello", id="lost-reply", max_tokens=3, idempotent=True)
        assert handle.id == "lost-reply"
        assert client.xlen(KEYS.queue()) == 2  # enqueued once
        proxy.pause()
        paused = Client(proxy.url, block_ms=100)
        paused.redis.connection_pool.connection_kwargs["socket_timeout"] = 0.5
        with pytest.raises(redis.TimeoutError):
            paused.submit("nothing", id="never")
        proxy.resume()
    assert not client.exists(KEYS.job("never"))


def test_cli_exits_3_when_redis_is_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert cli_main(["--redis-url", url, "submit", "hello"]) == 3
    assert "cannot reach Redis" in capsys.readouterr().err


def test_following_a_job_that_does_not_exist_ends(redis_server: RedisServer) -> None:
    producer = Client(redis_server.url, block_ms=100, missing_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(JobNotFound):
        producer.result("no-such-job", timeout=30)
    # Ended by missing_timeout_s (0.5 s), not by the 30 s result timeout: the bound leaves
    # a loaded host room and still tells them apart.
    assert time.monotonic() - started < 10
