"""The synchronous client: submit jobs, stream their tokens, wait, cancel.

>>> client = Client("redis://127.0.0.1:6379/0")
>>> job = client.submit(prompt="Hello", max_tokens=32)
>>> for event in job.stream():
...     if not event.final:  # the final event carries the whole text
...         print(event.text, end="", flush=True)
>>> job.result(timeout=60).text
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from redis.commands.core import Script

from batchd.config.limits import DEFAULT_REDIS_URL
from batchd.producers.base import ClientBase, HandleBase, JobLike
from batchd.producers.connection import redis_client
from batchd.producers.follow import COMMAND_ERRORS, Delivery, Follower, Pause, PlanDriver, issue
from batchd.producers.keys import check_name
from batchd.producers.result import JobResult, collect
from batchd.producers.schema import Event, JobStatus
from batchd.producers.transact import CANCEL, SUBMIT, SUBMIT_MANY, CancelPlan


class Client(ClientBase["JobHandle"]):
    """Producer side of batchd over one Redis connection pool (thread-safe).

    ``redis_url`` is a URL (``redis+sentinel://`` for a master behind Sentinel) or an
    existing ``redis.Redis`` (its socket timeout
    must exceed ``block_ms``). See :class:`~batchd.producers.base.ClientBase` for the
    other options.
    """

    def __init__(self, redis_url: str | redis.Redis = DEFAULT_REDIS_URL, **options: Any) -> None:
        super().__init__(**options)
        self.redis: redis.Redis = self.connect(redis_url, redis_client)
        self._submit = self.redis.register_script(SUBMIT)
        self._submit_many = self.redis.register_script(SUBMIT_MANY)
        self._cancel = self.redis.register_script(CANCEL)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit_request(
        self,
        job: JobLike,
        *,
        queue: str | None = None,
        idempotent: bool = False,
        key_id: str | None = None,
    ) -> JobHandle:
        plan = self.plan_submit(job, queue, key_id)
        reply, acked = self._write(self._submit, plan.keys, plan.args)
        handle = JobHandle(self, *self.check_submitted(plan, reply, idempotent, key_id))
        self.check_replicated(acked, [plan.job_id])
        return handle

    def submit_many(
        self, jobs: Iterable[JobLike], *, queue: str | None = None, idempotent: bool = False
    ) -> list[JobHandle]:
        """Enqueue several ready JobRequests (or their dicts) onto one queue, all or none,
        in one round trip; their handles, in order.

        A daemon waiting for work reads them together (one loop of :meth:`submit`
        would wake it for the first job alone). Every job is validated first; one that
        was already submitted raises ValidationError on ``id`` and nothing is enqueued,
        unless ``idempotent`` (its handle then attaches to it). At most
        MAX_SUBMIT_MANY jobs a call.
        """
        plan = self.plan_submit_many(jobs, queue, attach=idempotent)
        reply, acked = self._write(self._submit_many, plan.keys, plan.args)
        handles = [JobHandle(self, *job) for job in self.check_submitted_many(plan, reply)]
        self.check_replicated(acked, plan.job_ids)
        return handles

    def _write(self, script: Script, keys: list[Any], args: list[Any]) -> tuple[Any, int | None]:
        """A submit script's reply, and with ``replicas`` the replicas that confirmed it
        (WAIT on the same connection, so it waits for this write)."""
        if not self.replicas:
            return script(keys=keys, args=args), None
        pipe = self.redis.pipeline(transaction=False)
        script(keys=keys, args=args, client=pipe)
        pipe.wait(self.replicas, self.replicas_timeout_ms)
        reply, acked = pipe.execute()
        return reply, int(acked)

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
        return collect(job_id, self.stream(job_id, timeout=timeout))


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
    """Drive a :class:`~batchd.producers.follow.Follower` plan with blocking I/O."""
    driver = PlanDriver(follower.plan())
    while (step := driver.next_step()) is not None:
        if isinstance(step, Delivery):
            yield step
        elif isinstance(step, Pause):
            time.sleep(step.seconds)
        else:
            try:
                driver.answered(issue(connection, step))
            except COMMAND_ERRORS as exc:
                driver.failed(exc)
