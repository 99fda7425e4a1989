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
from batchd.producers.connection import async_redis_client
from batchd.producers.follow import COMMAND_ERRORS, Delivery, Follower, Pause, PlanDriver, issue
from batchd.producers.keys import check_name
from batchd.producers.result import JobResult, acollect
from batchd.producers.schema import Event, JobStatus
from batchd.producers.transact import CANCEL, SUBMIT, SUBMIT_MANY, CancelPlan


class AsyncClient(ClientBase[Coroutine[Any, Any, "AsyncJobHandle"]]):
    """Asyncio twin of :class:`~batchd.producers.client.Client`; see it for the semantics."""

    def __init__(self, redis_url: str | aioredis.Redis = DEFAULT_REDIS_URL, **options: Any) -> None:
        super().__init__(**options)
        self.redis: aioredis.Redis = self.connect(redis_url, async_redis_client)
        self._submit = self.redis.register_script(SUBMIT)
        self._submit_many = self.redis.register_script(SUBMIT_MANY)
        self._cancel = self.redis.register_script(CANCEL)

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
        plan = self.plan_submit(job, queue, key_id)
        reply, acked = await self._write(self._submit, plan.keys, plan.args)
        handle = AsyncJobHandle(self, *self.check_submitted(plan, reply, idempotent, key_id))
        self.check_replicated(acked, [plan.job_id])
        return handle

    async def submit_many(
        self, jobs: Iterable[JobLike], *, queue: str | None = None, idempotent: bool = False
    ) -> list[AsyncJobHandle]:
        """See :meth:`batchd.producers.client.Client.submit_many`."""
        plan = self.plan_submit_many(jobs, queue, attach=idempotent)
        reply, acked = await self._write(self._submit_many, plan.keys, plan.args)
        handles = [AsyncJobHandle(self, *job) for job in self.check_submitted_many(plan, reply)]
        self.check_replicated(acked, plan.job_ids)
        return handles

    async def _write(
        self, script: AsyncScript, keys: list[Any], args: list[Any]
    ) -> tuple[Any, int | None]:
        """See :meth:`batchd.producers.client.Client._write`."""
        if not self.replicas:
            return await script(keys=keys, args=args), None
        pipe = self.redis.pipeline(transaction=False)
        await script(keys=keys, args=args, client=pipe)
        pipe.wait(self.replicas, self.replicas_timeout_ms)
        reply, acked = await pipe.execute()
        return reply, int(acked)

    def handle(self, job_id: str, *, queue: str | None = None) -> AsyncJobHandle:
        return AsyncJobHandle(self, check_name("id", job_id), self.queue_name(queue))

    async def status(self, job_id: str) -> JobStatus:
        return self.parse_status(job_id, await self.redis.hgetall(self.keys.job(job_id)))

    async def cancel(self, job_id: str) -> bool:
        """See :meth:`batchd.producers.client.Client.cancel`."""
        plan = CancelPlan.make(self.keys, job_id)
        return self.cancel_made(plan, await self._cancel(keys=plan.keys, args=plan.args))

    async def stream(
        self, job_id: str, *, after_seq: int = -1, timeout: float | None = None
    ) -> AsyncIterator[Event]:
        """See :meth:`batchd.producers.client.Client.stream`."""
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
