"""The load one gateway process holds, and its recovery from a Redis restart.

redis-server (AOF), daemon and gateway run as separate processes, as in production
(batchd.daemon.bench.gateway.stack, which ``batchd bench --workload gateway`` measures
with the same scenarios); the requests come from raw sockets on 127.0.0.1
(batchd.daemon.bench.gateway.http_load), bounded in number and time. The 1,000-stream
run is marked slow; the default suite runs the acceptance sizes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from batchd.daemon.bench.gateway.load import (
    RESTART_IN_FLIGHT,
    GatewayOptions,
    burst,
    restart,
    sse,
)
from batchd.daemon.bench.gateway.stack import GatewayStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    # The preset by name: the daemon builds it (this process never imports mlx-lm,
    # which would lower its open-files limit below the sockets the tests hold).
    with GatewayStack(tmp_path_factory.mktemp("load"), model="tiny") as running:
        yield running


def settings(**values: Any) -> GatewayOptions:
    return GatewayOptions(
        **{"burst": 300, "streams": 400, "outage_s": 1.0, "after_s": 4.0, **values}
    )


def test_300_concurrent_requests_all_succeed(stack: GatewayStack) -> None:
    report = asyncio.run(burst(stack, settings(burst=300)))
    assert report["statuses"] == {200: 300}, (report, stack.logs())


def test_400_concurrent_streams_each_receive_every_token(stack: GatewayStack) -> None:
    report = asyncio.run(sse(stack, settings(streams=400)))
    assert report["statuses"] == {200: 400}, (report, stack.logs())
    assert report["streams_complete"] == 400, report


@pytest.mark.slow
def test_1000_concurrent_streams_each_receive_every_token(stack: GatewayStack) -> None:
    report = asyncio.run(sse(stack, settings(streams=1000)))
    assert report["statuses"] == {200: 1000} and report["streams_complete"] == 1000, report


def test_a_redis_restart_under_load_recovers_within_2_s(stack: GatewayStack) -> None:
    """Redis stops for a second under a steady load and comes back (from its AOF): the
    gateway is ready again within 2 s, and no request sent after Redis is back fails.
    Each sender gets a request in after Redis is back, which fails if the work the outage
    held up takes the whole 4 s after it to drain (how many more depends on the host's
    load, so that is the benchmark's figure, not a bound here)."""
    report = asyncio.run(restart(stack, settings(outage_s=1.0)))
    assert report["requests_after_redis_up"] >= RESTART_IN_FLIGHT, (report, stack.logs())
    assert report["failed_after_redis_up"] == 0, (report, stack.logs())
    ready = report["ready_after_up_s"]
    assert ready is not None and ready < 2.0, (report, stack.logs())
