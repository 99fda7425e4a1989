"""A command cut by a Sentinel failover is retried on the new master.

redis-py 8.1 asks the Sentinels for the master's address only when a pool hands out a
connection: the retry of a command whose connection dropped reconnected to the address
the connection last had, the killed master's, for the whole retry budget
(redis/redis-py#3874). The gateway's commands wait out a failover in that retry
(``redis_retry_s``), so a request whose command was in flight when the master died got
a 503 once the budget ran out, though the Sentinels had long named the new master.

Each test holds a command blocked on the master (BLPOP on a list nobody fills), kills
the master while it blocks, and checks that the command's retry reaches the promoted
replica: it then blocks there for its timeout and returns None.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from batchd.producers.connection import redis_client
from batchd.producers.gateway.options import GatewayOptions
from batchd.producers.gateway.serving import connections
from batchd.producers.gateway.serving.hub import Hub, running
from batchd.producers.keys import Keys, event_id
from batchd.producers.schema import Event, FinishReason, JobState, JobStatus
from support.daemon_harness import wait_until
from support.redis_server import RedisServer
from support.sentinel import SentinelDeployment, sentinel_deployment

KEYS = Keys()
# Long enough for the Sentinels to promote the replica while the command is retried.
RETRY_S = 40.0
BLPOP_S = 5  # how long a BLPOP blocks on the new master before it returns None


def _blocked_on(server: RedisServer) -> bool:
    with server.client() as client:
        info: Any = client.info("clients")
    return int(info["blocked_clients"]) >= 1


def _kill_while_blocked(deployment: SentinelDeployment) -> RedisServer:
    """Once a client blocks on the master: kill it and wait for the promotion."""
    wait_until(lambda: _blocked_on(deployment.master), timeout=30, what="a blocked command")
    return deployment.kill_master()


def test_the_gateways_command_cut_by_a_failover_is_retried_on_the_new_master(
    tmp_path: Path,
) -> None:
    options = GatewayOptions(api_keys=["sk"], files_dir=tmp_path / "files", redis_retry_s=RETRY_S)

    async def run(deployment: SentinelDeployment) -> tuple[Any, int]:
        commands = connections.commands(deployment.url, options)
        try:
            blocked = asyncio.ensure_future(commands.blpop(["never"], timeout=BLPOP_S))
            await asyncio.to_thread(_kill_while_blocked, deployment)
            reply = await blocked
            return reply, await _port_of(commands)
        finally:
            await commands.aclose()

    with sentinel_deployment(tmp_path / "redis", down_after_ms=1000) as deployment:
        reply, port = asyncio.run(run(deployment))
        assert reply is None
        assert port == deployment.master.port


def test_a_blocking_clients_command_cut_by_a_failover_is_retried_on_the_new_master(
    tmp_path: Path,
) -> None:
    with sentinel_deployment(tmp_path / "redis", down_after_ms=1000) as deployment:
        client = redis_client(
            deployment.url,
            socket_timeout=connections.COMMAND_TIMEOUT_S,
            retry=Retry(ExponentialBackoff(cap=0.25, base=0.01), int(RETRY_S / 0.25)),
            retry_on_error=connections.RETRIED,
        )
        with client, ThreadPoolExecutor(1) as pool:
            blocked = pool.submit(client.blpop, ["never"], BLPOP_S)
            _kill_while_blocked(deployment)
            assert blocked.result() is None
            assert int(client.info("server")["tcp_port"]) == deployment.master.port


def test_the_hub_follows_a_job_across_a_failover(tmp_path: Path) -> None:
    """The gateway's events reader, blocked in its read when the master dies, follows
    the job on the new master: the events written there reach the subscriber."""
    options = GatewayOptions(api_keys=["sk"], files_dir=tmp_path / "files", redis_retry_s=RETRY_S)

    async def run(deployment: SentinelDeployment) -> list[Event]:
        commands = connections.commands(deployment.url, options)
        hub = Hub(connections.reader(deployment.url, block_ms=5000), commands, KEYS)
        try:
            async with running(hub):
                await _write(commands, "job", Event(seq=0, token_id=1, text="a"))
                async with hub.subscribe("job") as sub:
                    first = await sub.get()
                    await asyncio.to_thread(_kill_while_blocked, deployment)
                    await _write(commands, "job", Event(seq=1, finish_reason=FinishReason.stop))
                    rest = [event async for event in sub.events()]
            assert first is not None
            return [first, *rest]
        finally:
            await hub.conn.aclose()
            await commands.aclose()

    with sentinel_deployment(tmp_path / "redis", down_after_ms=1000) as deployment:
        events = asyncio.run(run(deployment))
    assert [event.seq for event in events] == [0, 1]
    assert events[-1].final


async def _write(commands: aioredis.Redis, job_id: str, event: Event) -> None:
    """``event`` of ``job_id``, and its status (running: a write just before the kill may
    not have reached the replica), retried through a failover."""

    async def write() -> None:
        status = JobStatus(state=JobState.running, queue="default", queued_at=time.time())
        await commands.hset(KEYS.job(job_id), mapping=status.to_hash())
        await commands.xadd(KEYS.events(job_id), {"event": event.encode()}, id=event_id(event.seq))

    await connections.outlast(write, RETRY_S, "write")


async def _port_of(client: aioredis.Redis) -> int:
    info: dict[str, Any] = await client.info("server")
    return int(info["tcp_port"])
