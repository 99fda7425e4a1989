"""How much load one gateway process holds, measured as production runs it.

``cd tests && python -m producers.gateway.measure_load [scenario ...]`` starts a private
redis-server (AOF on, so a restart keeps the fleet's state), a ``batchd serve`` daemon
on the tiny preset and a ``batchd gateway``, each its own process, then runs the
scenarios named (all by default) and prints one JSON report:

- ``rps16``, ``rps256``: short non-streaming chat completions, 16 and 256 in flight:
  requests/s, p50 and p99 latency;
- ``burst``: N non-streaming requests sent at once (``--burst``, 300);
- ``sse``: N SSE streams open at once (``--streams``, 1000), each checked to receive
  every token (its token chunks equal its usage) and ``[DONE]``;
- ``restart``: Redis stopped for ``--outage-s`` and started again under a steady load:
  how long after Redis answers again the gateway is ready and every request succeeds.

Everything targets 127.0.0.1, every request has a timeout and every scenario a fixed
number of requests, so a run stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from support.daemon_harness import fast_settings, write_config
from support.http_load import Outcome, request, run
from support.redis_server import RedisServer, free_port

SCENARIOS = ("rps16", "rps256", "burst", "sse", "restart")
CHAT = "/v1/chat/completions"
ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "num_kv_blocks": 4096}


def chat(i: int, *, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Hello {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m producers.gateway.measure_load")
    p.add_argument("scenarios", nargs="*", choices=[*SCENARIOS, []], help="default: all")
    p.add_argument("--requests", type=int, default=600, help="requests per rps scenario")
    p.add_argument("--burst", type=int, default=300)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--outage-s", type=float, default=1.0)
    p.add_argument("--ready-path", default="/health/ready", help="readiness endpoint polled")
    p.add_argument("--after-s", type=float, default=8.0, help="load kept after Redis is back")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag")
    args = p.parse_args(argv)
    args.scenarios = args.scenarios or list(SCENARIOS)
    report: dict[str, Any] = {"settings": vars(args)}
    with tempfile.TemporaryDirectory(prefix="batchd-gw-load-") as tmp:
        stack = Stack(Path(tmp), args.gateway_arg)
        try:
            stack.start()
            for name in args.scenarios:
                report[name] = asyncio.run(SCENARIO_RUNS[name](stack, args))
                print(
                    name,
                    orjson.dumps(report[name], option=orjson.OPT_NON_STR_KEYS).decode(),
                    file=sys.stderr,
                )
        finally:
            stack.stop()
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
    return 0


class Stack:
    """redis-server (AOF), daemon and gateway, each a process of its own."""

    def __init__(self, tmp: Path, gateway_args: list[str]) -> None:
        self.tmp = tmp
        self.gateway_args = gateway_args
        self.redis = RedisServer(tmp / "redis", appendonly=True)
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self.redis.start()
        model = self._tiny_model()
        # The daemon's production heartbeat (10 s): a Redis restart shorter than that
        # leaves the fleet visible to the gateway.
        settings = fast_settings(
            self.redis.url, redis_retry_max_s=0.2, heartbeat_interval_s=1.0, heartbeat_ttl_s=10.0
        )
        for key, value in ENGINE.items():
            setattr(settings.engine, key, value)
        settings.log_level = "WARNING"
        config = write_config(self.tmp / "batchd.toml", settings)
        self._spawn("daemon", "--config", str(config), "serve", "--model", str(model))
        gateway = ["--redis-url", self.redis.url, "--log-level", "WARNING", "gateway"]
        gateway += ["--port", str(self.port), "--max-in-flight", "4096", "--max-backlog", "4096"]
        self._spawn("gateway", *gateway, *self.gateway_args)
        self._wait_live()

    def _tiny_model(self) -> Path:
        """The tiny preset, built in a child: importing mlx_lm lowers the process's
        open-files limit (mlx_lm.utils sets it to 2048/4096), which the gateway would
        inherit, and this process holds a socket per request."""
        folder = self.tmp / "tiny"
        script = (
            "import sys; from batchd.engine.models.model_fixture import FixtureSpec, make_model; "
            "make_model(sys.argv[1], FixtureSpec(preset='tiny'))"
        )
        subprocess.run([sys.executable, "-c", script, str(folder)], check=True, timeout=300)
        return folder

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
        command = [sys.executable, "-m", "batchd.daemon.cli", *args]
        self.procs.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp)
        )

    def _wait_live(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(self.logs())
            try:
                answer = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1)
                if answer.json().get("daemons"):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError("no live daemon seen by the gateway:\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.tmp.glob("*.log"))
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.kill()


async def rps(stack: Stack, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    warm = [chat(i, max_tokens=args.max_tokens) for i in range(concurrency)]
    await run(stack.port, CHAT, warm, concurrency=concurrency)
    bodies = [chat(i, max_tokens=args.max_tokens) for i in range(args.requests)]
    report = await run(stack.port, CHAT, bodies, concurrency=concurrency)
    return {"concurrency": concurrency, **report.summary()}


async def rps16(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    return await rps(stack, args, 16)


async def rps256(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    return await rps(stack, args, 256)


async def burst(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    bodies = [chat(i, max_tokens=args.max_tokens) for i in range(args.burst)]
    return (await run(stack.port, CHAT, bodies, concurrency=len(bodies))).summary()


async def sse(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    bodies = [chat(i, max_tokens=args.max_tokens, stream=True) for i in range(args.streams)]
    report = await run(stack.port, CHAT, bodies, concurrency=len(bodies), timeout_s=300)
    ok = [o for o in report.outcomes if o.status == 200]
    whole = [o for o in ok if o.done and o.usage_tokens is not None and o.tokens == o.usage_tokens]
    return {**report.summary(), "streams_complete": len(whole)}


async def restart(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """A steady load (16 in flight) and a /health/ready poll while Redis stops and starts."""
    timeline: list[tuple[float, Outcome]] = []
    ready: list[tuple[float, int]] = []
    stop_at = time.monotonic() + 1e9

    async def load() -> None:
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            started = time.monotonic()
            outcome = await request(
                stack.port, CHAT, chat(i, max_tokens=args.max_tokens), timeout_s=30
            )
            timeline.append((started, outcome))

    async def poll() -> None:
        while time.monotonic() < stop_at:
            outcome = await request(stack.port, args.ready_path, method="GET", timeout_s=2)
            ready.append((time.monotonic(), outcome.status))
            await asyncio.sleep(0.05)

    tasks = [asyncio.ensure_future(load()) for _ in range(16)] + [asyncio.ensure_future(poll())]
    await asyncio.sleep(3)
    down_at = time.monotonic()
    await asyncio.to_thread(stack.redis.stop)
    await asyncio.sleep(args.outage_s)
    await asyncio.to_thread(stack.redis.start)
    up_at = time.monotonic()
    stop_at = up_at + args.after_s
    await asyncio.gather(*tasks)
    after = [(s, o) for s, o in timeline if s >= up_at]
    failed_after = [s for s, o in after if o.status != 200]
    overlap = [(s, o) for s, o in timeline if s < up_at and s + o.latency_s > down_at]
    first_ready = next((t for t, status in ready if t >= up_at and status == 200), None)
    return {
        "outage_s": round(up_at - down_at, 2),
        "requests_after_redis_up": len(after),
        "failed_after_redis_up": len(failed_after),
        "last_failure_after_up_s": round(max(failed_after) - up_at, 2) if failed_after else None,
        "overlapping_outage": len(overlap),
        "overlapping_failed": sum(1 for _, o in overlap if o.status != 200),
        "ready_after_up_s": None if first_ready is None else round(first_ready - up_at, 2),
        "statuses_after_up": _statuses(o for _, o in after),
    }


def _statuses(outcomes: Any) -> dict[int, int]:
    counts: dict[int, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return counts


SCENARIO_RUNS = {"rps16": rps16, "rps256": rps256, "burst": burst, "sse": sse, "restart": restart}

if __name__ == "__main__":
    sys.exit(main())
