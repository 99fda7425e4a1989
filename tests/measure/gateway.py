"""The gateway's overhead: the same requests through the OpenAI gateway and through the
Python client, against one daemon, in alternating rounds.

``cd tests && python -m measure.gateway [--model NAME]`` starts a private
redis-server, a ``batchd serve`` daemon on ``--model`` (default: the tiny preset) and a
``batchd gateway``, all as separate processes as in production, then runs
``--requests`` short greedy completions with ``--concurrency`` in flight, first with
:class:`batchd.producers.aio.AsyncClient`
(submit + result), then with ``openai.AsyncOpenAI`` through the gateway, for
``--rounds`` rounds each. It prints requests/s and latency (p50, p90) of both
paths and their ratios: the gateway's cost is HTTP, JSON, the extra process
and the openai client's parsing, the engine's work being the same.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from batchd.daemon.redis_server import RedisServer, free_port
from batchd.producers.aio import AsyncClient

PROMPT = "Once upon a time, request {i}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m measure.gateway", description=__doc__)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--model", default="tiny", help="preset, model folder or .gguf file (default: tiny)"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchd-bench-gw-") as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            port = free_port()
            procs.append(_batchd(server.url, tmp, "daemon", "serve", "--model", _model(args.model)))
            procs.append(_batchd(server.url, tmp, "gateway", "gateway", "--port", str(port)))
            base = f"http://127.0.0.1:{port}"
            _wait_live(base, procs)
            report = asyncio.run(_compare(server.url, f"{base}/v1", args))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)
            server.kill()
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    return 0


def _model(model: str) -> str:
    """The model folder, built or converted into the model cache once, before any timing."""
    from batchd.engine.models.registry import resolve_model

    return resolve_model(model)


def _batchd(redis_url: str, tmp: str, name: str, *args: str) -> subprocess.Popen[bytes]:
    log = open(Path(tmp) / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    command = [sys.executable, "-m", "batchd.daemon.cli", "--redis-url", redis_url, "--log-level"]
    return subprocess.Popen(
        [*command, "WARNING", *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def _wait_live(base: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 180) -> None:
    """Until the gateway answers and sees the daemon's heartbeat."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the daemon or the gateway exited at start (see their logs)")
        try:
            if httpx.get(f"{base}/health", timeout=1).json().get("daemons"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the gateway did not see a live daemon in time")


async def _compare(redis_url: str, base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = AsyncClient(redis_url)
    gateway = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)

    async def direct(i: int) -> None:
        handle = await client.submit(
            PROMPT.format(i=i), max_tokens=args.max_tokens, temperature=0.0
        )
        await handle.result(timeout=120)

    async def through_gateway(i: int) -> None:
        await gateway.completions.create(
            model=args.model,
            prompt=PROMPT.format(i=i),
            max_tokens=args.max_tokens,
            temperature=0,
        )

    runs: dict[str, list[dict[str, float]]] = {"client": [], "gateway": []}
    await _load(direct, 2 * args.concurrency, args.concurrency)  # warm-up, untimed
    await _load(through_gateway, 2 * args.concurrency, args.concurrency)
    for _ in range(args.rounds):
        runs["client"].append(await _load(direct, args.requests, args.concurrency))
        runs["gateway"].append(await _load(through_gateway, args.requests, args.concurrency))
    await client.aclose()
    await gateway.close()
    best = {name: max(r, key=lambda x: x["requests_per_s"]) for name, r in runs.items()}
    return {
        "settings": vars(args),
        "runs": runs,
        "best": best,
        "gateway_over_client": {
            "requests_per_s": round(
                best["gateway"]["requests_per_s"] / best["client"]["requests_per_s"], 3
            ),
            "p50_latency": round(best["gateway"]["p50_s"] / best["client"]["p50_s"], 3),
            "added_p50_ms": round(1000 * (best["gateway"]["p50_s"] - best["client"]["p50_s"]), 1),
        },
    }


async def _load(
    call: Callable[[int], Awaitable[None]], requests: int, concurrency: int
) -> dict[str, float]:
    """``requests`` calls, ``concurrency`` at a time: throughput and latency figures."""
    latencies: list[float] = []
    todo = iter(range(requests))

    async def worker() -> None:
        for i in todo:
            start = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    deciles = statistics.quantiles(latencies, n=10)
    return {
        "requests_per_s": round(requests / wall, 2),
        "p50_s": round(statistics.median(latencies), 4),
        "p90_s": round(deciles[-1], 4),
    }


if __name__ == "__main__":
    sys.exit(main())
