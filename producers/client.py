"""The synchronous client: submit jobs, stream their tokens, wait, cancel.

>>> client = Client("redis://127.0.0.1:6379/0")
>>> job = client.submit(prompt="Hello", max_tokens=32)
>>> for event in job.stream():
...     print(event.text, end="", flush=True)
>>> job.result(timeout=60).text
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import redis

from config import DEFAULT_REDIS_URL
from producers.base import ClientBase, HandleBase
from producers.follow import (
    RECONNECT_ERRORS,
    Delivery,
    FetchStatus,
    Follower,
    Pause,
    PlanDriver,
    Read,
    Step,
    interrupted_read,
    read_reply,
)
from producers.keys import check_name
from producers.result import JobResult, ResultBuilder
from producers.schema import Event, JobRequest, JobStatus
from producers.transact import CANCEL, SUBMIT, CancelPlan


class Client(ClientBase):
    """Producer side of batchd over one Redis connection pool (thread-safe).

    ``redis_url`` is a URL or an existing ``redis.Redis`` (its socket timeout
    must exceed ``block_ms``). See :class:`~producers.base.ClientBase` for the
    other options.
    """

    def __init__(self, redis_url: str | redis.Redis = DEFAULT_REDIS_URL, **options: Any) -> None:
        super().__init__(**options)
        self.redis: redis.Redis = self.connect(redis_url, redis.Redis.from_url)
        self._submit = self.redis.register_script(SUBMIT)
        self._cancel = self.redis.register_script(CANCEL)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[Any] | None = None,
        prompt_token_ids: list[int] | None = None,
        id: str | None = None,
        queue: str | None = None,
        idempotent: bool = False,
        **options: Any,
    ) -> JobHandle:
        """Validate and enqueue a job; ``options`` are JobRequest fields (max_tokens,
        temperature, seed, n, priority, ttl_s, metadata, ...).

        Raises ValidationError naming the bad field; a job id already submitted
        raises ValidationError on ``id`` unless ``idempotent`` (then the handle
        attaches to the existing job and nothing is enqueued).
        """
        job = self.build_request(prompt, messages, prompt_token_ids, id, options)
        return self.submit_request(job, queue=queue, idempotent=idempotent)

    def submit_request(
        self,
        job: JobRequest | Mapping[str, Any],
        *,
        queue: str | None = None,
        idempotent: bool = False,
    ) -> JobHandle:
        """Enqueue a ready JobRequest (or its dict); same rules as :meth:`submit`."""
        plan = self.plan_submit(job, queue)
        reply = self._submit(keys=plan.keys, args=plan.args)
        return JobHandle(self, *self.check_submitted(plan, reply, idempotent))

    def handle(self, job_id: str, *, queue: str | None = None) -> JobHandle:
        """A handle on a job submitted elsewhere (by id)."""
        return JobHandle(self, check_name("id", job_id), self.queue_name(queue))

    def status(self, job_id: str) -> JobStatus:
        """The job's status hash; raises JobNotFound."""
        return self.parse_status(job_id, self.redis.hgetall(self.keys.job(job_id)))

    def cancel(self, job_id: str) -> bool:
        """Ask the daemon to cancel; False if the job had already ended.

        Sets ``cancel_requested`` on the status hash (the truth, checked at
        pickup) and notifies running daemons on the cancel stream. Raises
        JobNotFound. The job ends with a ``cancelled`` final event.
        """
        plan = CancelPlan.make(self.keys, job_id)
        return self.cancel_made(plan, self._cancel(keys=plan.keys, args=plan.args))

    def stream(
        self, job_id: str, *, after_seq: int = -1, timeout: float | None = None
    ) -> Iterator[Event]:
        """The job's events from ``after_seq + 1`` on, replayed then live, ending
        with the final event; no gap, no duplicate, across reconnects. Raises
        JobTimeout after ``timeout`` seconds."""
        follower = self.follower(timeout=timeout)
        follower.add(job_id, after_seq=after_seq)
        for delivery in follow(self.redis, follower):
            yield delivery.event

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job to end; raises JobFailed (error, cancelled, expired)
        or JobTimeout."""
        builder = ResultBuilder(job_id)
        for event in self.stream(job_id, timeout=timeout):
            if (result := builder.add(event)) is not None:
                return result
        raise AssertionError("a stream always ends with a final event")


class JobHandle(HandleBase["Client"]):
    """One submitted job."""

    def stream(self, *, after_seq: int = -1, timeout: float | None = None) -> Iterator[Event]:
        """See :meth:`Client.stream`."""
        return self.client.stream(self.id, after_seq=after_seq, timeout=timeout)

    def result(self, timeout: float | None = None) -> JobResult:
        """See :meth:`Client.result`."""
        return self.client.result(self.id, timeout)

    def cancel(self) -> bool:
        return self.client.cancel(self.id)

    def status(self) -> JobStatus:
        return self.client.status(self.id)


def follow(connection: redis.Redis, follower: Follower) -> Iterator[Delivery]:
    """Drive a :class:`~producers.follow.Follower` plan with blocking I/O."""
    driver = PlanDriver(follower.plan())
    while (step := driver.next_step()) is not None:
        if isinstance(step, Delivery):
            yield step
        elif isinstance(step, Pause):
            time.sleep(step.seconds)
        else:
            try:
                driver.answered(execute_step(connection, step))
            except RECONNECT_ERRORS as exc:
                driver.failed(exc)


def execute_step(connection: redis.Redis, step: Step) -> Any:
    if isinstance(step, Read):
        try:
            raw = connection.xread(step.streams, count=step.count, block=step.block_ms)
        except redis.ResponseError as exc:
            raise interrupted_read(exc) from exc
        return read_reply(raw)
    assert isinstance(step, FetchStatus)
    with connection.pipeline(transaction=False) as pipe:
        for key in step.keys:
            pipe.hgetall(key)
        return pipe.execute()
