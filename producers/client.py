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
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import MovedError

from batchd.config.limits import DEFAULT_REDIS_URL
from batchd.producers.base import ClientBase, HandleBase, JobLike
from batchd.producers.connection import is_cluster, read_layout, redis_client, reread_cluster
from batchd.producers.follow import COMMAND_ERRORS, Delivery, Follower, Pause, PlanDriver, issue
from batchd.producers.keys import Keys, check_name
from batchd.producers.result import JobResult, collect
from batchd.producers.schema import Event, JobStatus
from batchd.producers.transact import CANCEL, SUBMIT, SUBMIT_MANY, CancelPlan

# A script call: the script, its keys, its arguments.
ScriptCall = tuple[Script, list[Any], list[Any]]
# How often a cluster submit that waits for replicas is sent again after MOVED (its
# slot moved between the lookup and the call): redis-py's own retries do not see it.
MOVED_RETRIES = 3


class Client(ClientBase["JobHandle"]):
    """Producer side of batchd over one Redis connection pool (thread-safe).

    ``redis_url`` is a URL (``redis+sentinel://`` for a master behind Sentinel,
    ``redis+cluster://`` for a Redis Cluster) or an existing ``redis.Redis`` or
    ``RedisCluster`` (its socket timeout
    must exceed ``block_ms``). See :class:`~batchd.producers.base.ClientBase` for the
    other options. A URL's cluster client reads the slots again after a node is lost
    (:mod:`batchd.producers.connection.factory`); a ``RedisCluster`` of your own keeps
    redis-py's handling.
    """

    def __init__(self, redis_url: str | redis.Redis = DEFAULT_REDIS_URL, **options: Any) -> None:
        super().__init__(**options)
        self.redis: redis.Redis = self.connect(redis_url, redis_client)
        self.cluster = is_cluster(self.redis)
        self._submit = self.redis.register_script(SUBMIT)
        self._submit_many = self.redis.register_script(SUBMIT_MANY)
        self._cancel = self.redis.register_script(CANCEL)

    @property
    def keys(self) -> Keys:
        """The deployment's key names: read from Redis at each use until a daemon has
        stored the layout, then kept (:mod:`batchd.producers.connection.layout`)."""
        if self._keys is not None:
            return self._keys
        keys, stored = read_layout(self.redis, self.prefix)
        if stored:
            self._keys = keys
        return keys

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
        [reply], acked = self._write([(self._submit, plan.keys, plan.args)])
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

        With a partitioned layout (:mod:`batchd.producers.keys`) the jobs go in one script
        per partition, each job's order kept within its partition (daemons read the
        partitions side by side), after one read of every job's status hash (see
        :class:`~batchd.producers.transact.SubmitManyCall`): a job submitted by someone
        else between that read and its partition's script raises ValidationError
        naming the jobs of the partitions already queued.
        """
        call = self.plan_submit_many(jobs, queue, attach=idempotent)
        if call.checks_first:
            with self.redis.pipeline(transaction=False) as pipe:
                for job_id in call.job_ids:
                    pipe.hmget(self.keys.job(job_id), call.checked)
                self.check_not_submitted(call, pipe.execute())
        writes = [(self._submit_many, part.keys, part.args) for part in call.parts]
        replies, acked = self._write(writes)
        handles = [JobHandle(self, *job) for job in self.check_submitted_many(call, replies)]
        self.check_replicated(acked, call.job_ids)
        return handles

    def _write(self, calls: list[ScriptCall]) -> tuple[list[Any], int | None]:
        """Each submit script's reply, and with ``replicas`` the fewest replicas that
        confirmed one (WAIT on the connection that ran it, so it waits for that write).
        One round trip on a single Redis; on a Cluster one per script, each on the
        primary of its partition's slot."""
        if self.cluster:
            return replicated(self.redis, calls, self.replicas, self.replicas_timeout_ms)
        if len(calls) == 1 and not self.replicas:
            script, keys, args = calls[0]
            return [script(keys=keys, args=args)], None
        with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                script(keys=keys, args=args, client=pipe)
            if self.replicas:
                pipe.wait(self.replicas, self.replicas_timeout_ms)
            replies = pipe.execute()
        if not self.replicas:
            return replies, None
        return replies[:-1], int(replies[-1])

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


def replicated(
    cluster: redis.Redis, calls: list[ScriptCall], replicas: int, timeout_ms: int
) -> tuple[list[Any], int | None]:
    """Run submit scripts on a Redis Cluster, one at a time; with ``replicas``, each in a
    pipeline with WAIT on a connection to its slot's primary (WAIT counts the replicas
    that hold the writes of its own connection, so it cannot ride the cluster client,
    which may pick another). The replies, and the fewest replicas that confirmed one."""
    replies: list[Any] = []
    acked: int | None = None
    for script, keys, args in calls:
        if not replicas:
            replies.append(script(keys=keys, args=args))
            continue
        reply, count = _waited(cluster, (script, keys, args), replicas, timeout_ms)
        replies.append(reply)
        acked = count if acked is None else min(acked, count)
    return replies, acked


def _waited(
    cluster: redis.Redis, call: ScriptCall, replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    """One script then WAIT on one primary's connection; sent again (the script is
    idempotent by its submit token) when the slot moved under it. The pipeline is the
    node's own client's, past the cluster client's re-read of the slots after a node is
    lost (:mod:`batchd.producers.connection.factory`): an unreachable node makes it read
    them here (:func:`reread_cluster`)."""
    nodes: RedisCluster = cluster  # type: ignore[assignment]
    script, keys, args = call
    moved = 0
    while True:
        primary = nodes.get_redis_connection(nodes.get_node_from_key(keys[0]))
        try:
            with primary.pipeline(transaction=False) as pipe:
                script(keys=keys, args=args, client=pipe)
                pipe.wait(replicas, timeout_ms)
                reply, count = pipe.execute()
            return reply, int(count)
        except MovedError:
            moved += 1
            if moved > MOVED_RETRIES:
                raise
            nodes.nodes_manager.initialize()
        except redis.RedisError as exc:
            reread_cluster(nodes, exc)
            raise


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
