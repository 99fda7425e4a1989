"""The load one gateway process holds, and its recovery from a Redis restart.

redis-server (AOF), daemon and gateway run as separate processes, as in production
(:mod:`measure_load`, which also prints the figures); the requests come from raw
sockets on 127.0.0.1 (:mod:`support.http_load`), bounded in number and time. The
1,000-stream run is marked slow; the default suite runs the acceptance sizes.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from measure_load import Stack, burst, restart, sse


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("load"), [])
    try:
        running.start()
        yield running
    finally:
        running.stop()


def settings(**values: Any) -> argparse.Namespace:
    base = {"max_tokens": 8, "burst": 300, "streams": 400, "outage_s": 1.0}
    base.update(ready_path="/health/ready", after_s=4.0)
    return argparse.Namespace(**{**base, **values})


def test_300_concurrent_requests_all_succeed(stack: Stack) -> None:
    report = asyncio.run(burst(stack, settings(burst=300)))
    assert report["statuses"] == {200: 300}, (report, stack.logs())


def test_400_concurrent_streams_each_receive_every_token(stack: Stack) -> None:
    report = asyncio.run(sse(stack, settings(streams=400)))
    assert report["statuses"] == {200: 400}, (report, stack.logs())
    assert report["streams_complete"] == 400, report


@pytest.mark.slow
def test_1000_concurrent_streams_each_receive_every_token(stack: Stack) -> None:
    report = asyncio.run(sse(stack, settings(streams=1000)))
    assert report["statuses"] == {200: 1000} and report["streams_complete"] == 1000, report


def test_a_redis_restart_under_load_recovers_within_2_s(stack: Stack) -> None:
    """Redis stops for a second under a steady load and comes back (from its AOF): the
    gateway is ready again within 2 s, and no request sent after Redis is back fails."""
    report = asyncio.run(restart(stack, settings(outage_s=1.0)))
    assert report["requests_after_redis_up"] > 50, report
    assert report["failed_after_redis_up"] == 0, (report, stack.logs())
    assert report["ready_after_up_s"] is not None and report["ready_after_up_s"] < 2.0, report
