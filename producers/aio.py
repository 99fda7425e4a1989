"""The asyncio client (redis.asyncio): the same API as :mod:`batchd.producers.client`, awaited.

>>> client = AsyncClient("redis://127.0.0.1:6379/0")
>>> job = await client.submit(prompt="Hello", max_tokens=32)
>>> async for event in job.stream():
...     if not event.final:  # the final event carries the whole text
...         print(event.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from batchd.config.limits import DEFAULT_REDIS_URL
from batchd.producers.base import ClientBase, HandleBase, JobLike
from batchd.producers.connection import async_read_layout, async_redis_client, is_cluster
from batchd.producers.follow import COMMAND_ERRORS, Delivery, Follower, Pause, PlanDriver, issue
from batchd.producers.keys import Keys, check_name
from batchd.producers.result import JobResult, acollect
from batchd.producers.schema import Event, JobStatus
from batchd.producers.transact import CANCEL, SUBMIT, SUBMIT_MANY, CancelPlan


class AsyncClient(ClientBase[Coroutine[Any, Any, "AsyncJobHandle"]]):
    """Asyncio twin of :class:`~batchd.producers.client.Client`; see it for the semantics.

    On a Redis Cluster ``replicas`` is refused: WAIT counts the replicas holding its own
    connection's writes, and redis-py's asyncio cluster client cannot pin a connection
    to one primary (the sync client can).
    """

    def __init__(self, redis_url: str | aioredis.Redis = DEFAULT_REDIS_URL, **options: Any) -> None:
        super().__init__(**options)
        self.redis: aioredis.Redis = self.connect(redis_url, async_redis_client)
        self.cluster = is_cluster(self.redis)
        if self.cluster and self.replicas:
            raise ValueError(
                "replicas= is not supported by the AsyncClient on Redis Cluster (WAIT must "
                "run on the connection that wrote the submit): use the sync Client, or "
                "replicas=0 with the cluster's own min-replicas-to-write"
            )
        self._submit = self.redis.register_script(SUBMIT)
        self._submit_many = self.redis.register_script(SUBMIT_MANY)
        self._cancel = self.redis.register_script(CANCEL)
        self._layout_stored = False  # kept from then on: see layout()

    async def layout(self) -> Keys:
        """The deployment's key names: read from Redis by each command until a daemon has
        stored the layout, then kept (:mod:`batchd.producers.connection.layout`)."""
        if self._keys is None or not self._layout_stored:
            self._keys, self._layout_stored = await async_read_layout(self.redis, self.prefix)
        return self._keys

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit_request(
        self,
        job: JobLike,
        *,
        queue: str | None = None,
        idempotent: bool = False,
        key_id: str | None = None,
    ) -> AsyncJobHandle:
        await self.layout()
        plan = self.plan_submit(job, queue, key_id)
        [reply], acked = await self._write([(self._submit, plan.keys, plan.args)])
        handle = AsyncJobHandle(self, *self.check_submitted(plan, reply, idempotent, key_id))
        self.check_replicated(acked, [plan.job_id])
        return handle

    async def submit_many(
        self, jobs: Iterable[JobLike], *, queue: str | None = None, idempotent: bool = False
    ) -> list[AsyncJobHandle]:
        """See :meth:`batchd.producers.client.Client.submit_many`."""
        keys = await self.layout()
        call = self.plan_submit_many(jobs, queue, attach=idempotent)
        if call.checks_first:
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in call.job_ids:
                    pipe.hmget(keys.job(job_id), call.checked)
                self.check_not_submitted(call, await pipe.execute())
        writes = [(self._submit_many, part.keys, part.args) for part in call.parts]
        replies, acked = await self._write(writes)
        handles = [AsyncJobHandle(self, *job) for job in self.check_submitted_many(call, replies)]
        self.check_replicated(acked, call.job_ids)
        return handles

    async def _write(
        self, calls: list[tuple[AsyncScript, list[Any], list[Any]]]
    ) -> tuple[list[Any], int | None]:
        """See :meth:`batchd.producers.client.Client._write` (on a Cluster, without
        ``replicas``: refused at construction)."""
        if self.cluster or (len(calls) == 1 and not self.replicas):
            return [await script(keys=keys, args=args) for script, keys, args in calls], None
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            if self.replicas:
                pipe.wait(self.replicas, self.replicas_timeout_ms)
            replies = await pipe.execute()
        if not self.replicas:
            return replies, None
        return replies[:-1], int(replies[-1])

    def handle(self, job_id: str, *, queue: str | None = None) -> AsyncJobHandle:
        return AsyncJobHandle(self, check_name("id", job_id), self.queue_name(queue))

    async def status(self, job_id: str) -> JobStatus:
        keys = await self.layout()
        return self.parse_status(job_id, await self.redis.hgetall(keys.job(job_id)))

    async def cancel(self, job_id: str) -> bool:
        """See :meth:`batchd.producers.client.Client.cancel`."""
        plan = CancelPlan.make(await self.layout(), job_id)
        return self.cancel_made(plan, await self._cancel(keys=plan.keys, args=plan.args))

    async def stream(
        self, job_id: str, *, after_seq: int = -1, timeout: float | None = None
    ) -> AsyncIterator[Event]:
        """See :meth:`batchd.producers.client.Client.stream`."""
        await self.layout()
        follower = self.follower(timeout=timeout)
        follower.add(job_id, after_seq=after_seq)
        async for delivery in follow(self.redis, follower):
            yield delivery.event

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """See :meth:`batchd.producers.client.Client.result`."""
        return await acollect(job_id, self.stream(job_id, timeout=timeout))


class AsyncJobHandle(HandleBase["AsyncClient"]):
    """One submitted job, for asyncio code."""

    def stream(self, *, after_seq: int = -1, timeout: float | None = None) -> AsyncIterator[Event]:
        return self.client.stream(self.id, after_seq=after_seq, timeout=timeout)

    async def result(self, timeout: float | None = None) -> JobResult:
        return await self.client.result(self.id, timeout)

    async def cancel(self) -> bool:
        return await self.client.cancel(self.id)

    async def status(self) -> JobStatus:
        return await self.client.status(self.id)


async def follow(connection: aioredis.Redis, follower: Follower) -> AsyncIterator[Delivery]:
    """Drive a :class:`~batchd.producers.follow.Follower` plan with asyncio I/O."""
    driver = PlanDriver(follower.plan())
    while (step := driver.next_step()) is not None:
        if isinstance(step, Delivery):
            yield step
        elif isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
        else:
            try:
                driver.answered(await issue(connection, step))
            except COMMAND_ERRORS as exc:
                driver.failed(exc)
