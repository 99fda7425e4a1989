"""``batchd bench --workload gateway``: how much load one gateway process holds.

A private redis-server (AOF on), a ``batchd serve`` daemon and a ``batchd gateway`` run
as their own processes (``stack``); the requests come from raw sockets on 127.0.0.1
(``http_load``). The scenarios, in this order:

- ``rps16``, ``rps256``: short non-streaming chat completions, 16 and 256 in flight
  (after a warm-up of as many): requests/s, p50 and p99 latency;
- ``burst``: that many non-streaming requests sent at once;
- ``sse``: that many SSE streams open at once, each checked to receive every token (its
  token chunks equal its usage) and ``[DONE]``;
- ``restart``: Redis stopped for ``outage_s`` and started again under a steady load of
  16 in flight: how soon after Redis answers again the gateway is ready, and whether any
  request sent after that fails.

Every request has a timeout and every scenario a fixed number of requests (the restart
one a fixed time), so a run stops by itself.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from batchd.daemon.bench.gateway.http_load import Outcome, request, run
from batchd.daemon.bench.gateway.stack import GatewayStack
from batchd.daemon.bench.progress import Progress
from batchd.engine.blas import cpu_description

GATEWAY_WORKLOAD = "gateway"
SCENARIOS = ("rps16", "rps256", "burst", "sse", "restart")
CHAT = "/v1/chat/completions"
READY = "/health/ready"
# In flight during the restart scenario, and how long that load runs before Redis stops
# (so the outage falls on a steady state, not on the load's start).
RESTART_IN_FLIGHT = 16
LEAD_IN_S = 3.0


@dataclass(frozen=True)
class GatewayOptions:
    """The scenarios' sizes (the CLI fills these; tests shrink them)."""

    requests: int = 1000
    """Requests of each rps scenario."""
    burst: int = 300
    """Requests sent at once in the burst scenario."""
    streams: int = 1000
    """SSE streams open at once in the sse scenario."""
    outage_s: float = 1.0
    """How long Redis is down in the restart scenario."""
    after_s: float = 8.0
    """How long the restart scenario's load goes on after Redis is back."""
    max_tokens: int = 8
    """Tokens of every completion (greedy)."""
    model: str = "tiny"
    """What the daemon serves: a preset, a model directory or a .gguf file."""
    command: str = ""

    def __post_init__(self) -> None:
        sizes = {"requests": self.requests, "burst": self.burst, "streams": self.streams}
        sizes["max_tokens"] = self.max_tokens
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"gateway {name} must be at least 1, got {value}")
        if self.outage_s <= 0 or self.after_s <= 0:
            raise ValueError(
                f"gateway outage_s and after_s must be positive, got {self.outage_s}, "
                f"{self.after_s}"
            )


def run_gateway(options: GatewayOptions, progress: Progress) -> dict[str, Any]:
    """Start the stack, run every scenario, stop it; the report (settings, machine, the
    scenarios' figures under ``workloads.gateway``, headline)."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="batchd-bench-gateway-") as tmp:
        progress.phase(f"gateway: starting redis-server, batchd serve ({options.model}), gateway")
        with GatewayStack(Path(tmp), model=options.model) as stack:
            for name in SCENARIOS:
                progress.phase(f"gateway / {name}")
                results[name] = asyncio.run(SCENARIO_RUNS[name](stack, options))
                progress.say(f"gateway / {name}: {scenario_line(name, results[name])}")
    report: dict[str, Any] = {
        "settings": {"workloads": [GATEWAY_WORKLOAD], **asdict(options)},
        "machine": machine_info(),
        "workloads": {GATEWAY_WORKLOAD: results},
    }
    report["headline"] = headline(results)
    return report


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (the gateway never loads MLX)."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "batchd": metadata.version("batchd"),
    }


def chat(
    stack: GatewayStack, i: int, options: GatewayOptions, *, stream: bool = False
) -> dict[str, Any]:
    """A short greedy chat completion; ``i`` makes each prompt its own."""
    body: dict[str, Any] = {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": f"Hello {i}"}],
        "max_tokens": options.max_tokens,
        "temperature": 0,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def rps(stack: GatewayStack, options: GatewayOptions, concurrency: int) -> dict[str, Any]:
    """``options.requests`` completions, ``concurrency`` in flight, after a warm-up of
    as many as will be in flight."""
    warm = [chat(stack, i, options) for i in range(min(concurrency, options.requests))]
    await run(stack.port, CHAT, warm, concurrency=concurrency)
    bodies = [chat(stack, i, options) for i in range(options.requests)]
    report = await run(stack.port, CHAT, bodies, concurrency=concurrency)
    return {"concurrency": concurrency, **report.summary()}


async def rps16(stack: GatewayStack, options: GatewayOptions) -> dict[str, Any]:
    return await rps(stack, options, 16)


async def rps256(stack: GatewayStack, options: GatewayOptions) -> dict[str, Any]:
    return await rps(stack, options, 256)


async def burst(stack: GatewayStack, options: GatewayOptions) -> dict[str, Any]:
    """``options.burst`` completions sent at once."""
    bodies = [chat(stack, i, options) for i in range(options.burst)]
    return (await run(stack.port, CHAT, bodies, concurrency=len(bodies))).summary()


async def sse(stack: GatewayStack, options: GatewayOptions) -> dict[str, Any]:
    """``options.streams`` streams open at once; ``streams_complete`` counts those that
    got a 200, ``[DONE]`` and as many token chunks as their usage says."""
    bodies = [chat(stack, i, options, stream=True) for i in range(options.streams)]
    report = await run(stack.port, CHAT, bodies, concurrency=len(bodies), timeout_s=300)
    whole = [
        o
        for o in report.outcomes
        if o.status == 200 and o.done and o.usage_tokens is not None and o.tokens == o.usage_tokens
    ]
    return {**report.summary(), "streams_complete": len(whole)}


async def restart(stack: GatewayStack, options: GatewayOptions) -> dict[str, Any]:
    """A steady load and a readiness poll while Redis stops for ``outage_s`` and starts.

    ``ready_after_up_s``: from Redis answering again to the first 200 of /health/ready;
    ``failed_after_redis_up``: requests sent after that moment that did not get a 200;
    ``overlapping_*``: requests that were in flight while Redis was down;
    ``overlapping_done_after_up_s``: when the last of those ended, from Redis answering
    again, and ``slowest_after_up_s`` the longest request sent after it (how long the
    work Redis's outage held up took to drain).
    """
    timeline: list[tuple[float, Outcome]] = []
    ready: list[tuple[float, int]] = []
    stop_at = float("inf")

    async def load() -> None:
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            started = time.monotonic()
            outcome = await request(stack.port, CHAT, chat(stack, i, options), timeout_s=30)
            timeline.append((started, outcome))

    async def poll() -> None:
        while time.monotonic() < stop_at:
            outcome = await request(stack.port, READY, method="GET", timeout_s=2)
            ready.append((time.monotonic(), outcome.status))
            await asyncio.sleep(0.05)

    tasks = [asyncio.ensure_future(load()) for _ in range(RESTART_IN_FLIGHT)]
    tasks.append(asyncio.ensure_future(poll()))
    await asyncio.sleep(LEAD_IN_S)
    down_at = time.monotonic()
    await asyncio.to_thread(stack.redis.stop)
    await asyncio.sleep(options.outage_s)
    await asyncio.to_thread(stack.redis.start)
    up_at = time.monotonic()
    stop_at = up_at + options.after_s
    await asyncio.gather(*tasks)
    after = [(s, o) for s, o in timeline if s >= up_at]
    failed_after = [s for s, o in after if o.status != 200]
    overlap = [o for s, o in timeline if s < up_at and s + o.latency_s > down_at]
    first_ready = next((t for t, status in ready if t >= up_at and status == 200), None)
    return {
        "outage_s": round(up_at - down_at, 2),
        "in_flight": RESTART_IN_FLIGHT,
        "requests_after_redis_up": len(after),
        "failed_after_redis_up": len(failed_after),
        "last_failure_after_up_s": round(max(failed_after) - up_at, 2) if failed_after else None,
        "overlapping_outage": len(overlap),
        "overlapping_failed": sum(1 for o in overlap if o.status != 200),
        "overlapping_done_after_up_s": round(
            max((s + o.latency_s for s, o in timeline if s < up_at), default=up_at) - up_at, 2
        ),
        "slowest_after_up_s": round(max((o.latency_s for _, o in after), default=0.0), 2),
        "ready_after_up_s": None if first_ready is None else round(first_ready - up_at, 2),
        "statuses_after_up": _statuses(o for _, o in after),
    }


def _statuses(outcomes: Iterable[Outcome]) -> dict[int, int]:
    return dict(sorted(Counter(o.status for o in outcomes).items()))


SCENARIO_RUNS = {"rps16": rps16, "rps256": rps256, "burst": burst, "sse": sse, "restart": restart}


def scenario_line(name: str, result: dict[str, Any]) -> str:
    """One scenario's figures in words, for the progress line and the report's table."""
    if name == "restart":
        ready = result["ready_after_up_s"]
        return (
            f"Redis down {result['outage_s']} s: ready "
            + ("never" if ready is None else f"{ready} s after it answered")
            + f"; {result['failed_after_redis_up']} of {result['requests_after_redis_up']} "
            f"requests after it failed; {result['overlapping_failed']} of "
            f"{result['overlapping_outage']} that overlapped the outage failed"
        )
    line = (
        f"{result['requests_per_s']} requests/s, p50 {result['p50_ms']} ms, "
        f"p99 {result['p99_ms']} ms"
    )
    if name == "sse":
        line = f"{result['streams_complete']} of {result['requests']} streams complete, " + line
    failed = result["requests"] - result["statuses"].get(200, 0)
    return line + (f", {failed} not 200 {result['statuses']}" if failed else ", no error")


def headline(results: dict[str, Any]) -> str:
    """The run in one line: requests/s and p99 at 16 and 256 in flight, streams held,
    readiness after the Redis restart."""
    r16, r256, streams, back = (results[k] for k in ("rps16", "rps256", "sse", "restart"))
    ready = back["ready_after_up_s"]
    return (
        f"gateway {r16['requests_per_s']} req/s at 16 in flight (p99 {r16['p99_ms']} ms), "
        f"{r256['requests_per_s']} at 256 (p99 {r256['p99_ms']} ms); "
        f"{streams['streams_complete']}/{streams['requests']} SSE streams complete; "
        + (
            "not ready after the Redis restart"
            if ready is None
            else f"ready {ready} s after a Redis restart"
        )
    )
