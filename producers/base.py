"""What the sync and async clients share: building requests, key names, decisions.

Everything here is free of I/O, so :mod:`batchd.producers.client` and
:mod:`batchd.producers.aio` differ only in how they talk to Redis.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from batchd.config.limits import LimitSettings
from batchd.producers.errors import JobNotFound, NotReplicated, ValidationError
from batchd.producers.follow import Follower
from batchd.producers.keys import DEFAULT_PREFIX, DEFAULT_QUEUE, Keys, check_name, lane
from batchd.producers.schema import (
    JobRequest,
    JobState,
    JobStatus,
    encode_job,
    job_seed,
    new_job_id,
    now,
    validate_job,
)
from batchd.producers.transact import (
    CancelPlan,
    SubmitManyCall,
    SubmitManyPlan,
    SubmitPlan,
    by_partition,
)

ConnectionT = TypeVar("ConnectionT")
# What submitting gives: a job handle, or (asyncio) an awaitable of one.
SubmittedT = TypeVar("SubmittedT")
# A job to submit: a JobRequest, or its fields as a mapping.
JobLike = JobRequest | Mapping[str, Any]

# The most jobs one submit_many call takes: its script holds Redis for every job in it.
MAX_SUBMIT_MANY = 1000

# Headroom of the socket timeout over the longest XREAD BLOCK (redis-py #2807, #3138).
SOCKET_TIMEOUT_MARGIN_S = 10.0


class ClientBase(ABC, Generic[SubmittedT]):
    """Options and I/O-free logic of :class:`~batchd.producers.client.Client` and
    :class:`~batchd.producers.aio.AsyncClient`.

    ``limits`` (usually ``Settings().limits``) are checked client-side at
    submit, so a job the daemon would refuse fails at once with a
    ValidationError. ``block_ms`` is the longest XREAD BLOCK; the connection's
    socket timeout must exceed it. ``reconnect_timeout_s`` is how long a stream
    keeps retrying an unreachable Redis before the error propagates;
    ``missing_timeout_s`` how long following a job that has neither a status
    hash nor an event waits before raising JobNotFound. ``replicas`` above 0: a submit
    returns once that many replicas hold it (Redis ``WAIT`` on the submit's connection,
    up to ``replicas_timeout_ms``), so a failover cannot lose it; NotReplicated when
    fewer confirm in time. On Redis Cluster the WAIT goes to the primary that took each
    partition's script (the sync client only: see :class:`~batchd.producers.aio.AsyncClient`).
    """

    # Whether the client talks to a Redis Cluster (set by the subclass once connected):
    # a read over several partitions' keys must then be split by slot.
    cluster = False

    def __init__(
        self,
        *,
        prefix: str = DEFAULT_PREFIX,
        queue: str = DEFAULT_QUEUE,
        limits: LimitSettings | None = None,
        block_ms: int = 1000,
        reconnect_timeout_s: float = 60.0,
        missing_timeout_s: float = 10.0,
        replicas: int = 0,
        replicas_timeout_ms: int = 1000,
    ) -> None:
        self.prefix = prefix
        # The deployment's key names, read from Redis by the first command that needs one
        # (:mod:`batchd.producers.connection.layout`): a count assumed here could add jobs
        # no daemon reads.
        self._keys: Keys | None = None
        self.queue = check_name("queue", queue)
        self.limits = limits
        self.block_ms = block_ms
        self.reconnect_timeout_s = reconnect_timeout_s
        self.missing_timeout_s = missing_timeout_s
        if replicas < 0 or replicas_timeout_ms < 0:
            raise ValueError("replicas and replicas_timeout_ms must be >= 0")
        self.replicas = replicas
        self.replicas_timeout_ms = replicas_timeout_ms

    def connection_options(self) -> dict[str, Any]:
        return {
            "socket_timeout": self.block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
            "socket_connect_timeout": 5.0,
            "health_check_interval": 30,
        }

    def connect(
        self, redis_url: str | ConnectionT, from_url: Callable[..., ConnectionT]
    ) -> ConnectionT:
        """A new connection pool for a URL; a given connection after checking its timeout."""
        if isinstance(redis_url, str):
            return from_url(redis_url, **self.connection_options())
        self.check_connection(_connection_kwargs(redis_url))
        return redis_url

    @property
    def keys(self) -> Keys:
        """The deployment's key names; the sync client reads them on first use, the async
        one in its first command (:meth:`~batchd.producers.aio.AsyncClient.layout`)."""
        if self._keys is None:
            raise RuntimeError(
                "the key layout is not read yet: await client.layout() first (every "
                "AsyncClient command does)"
            )
        return self._keys

    def check_connection(self, connection_kwargs: Mapping[str, Any]) -> None:
        timeout = connection_kwargs.get("socket_timeout")
        if timeout is not None and timeout * 1000 <= self.block_ms:
            raise ValueError(
                f"socket_timeout {timeout}s must exceed the XREAD block of {self.block_ms} ms"
            )

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
    ) -> SubmittedT:
        """Validate and enqueue a job; ``options`` are JobRequest fields (max_tokens,
        temperature, seed, n, priority, ttl_s, metadata, ...). The async client's
        returns an awaitable.

        Raises ValidationError naming the bad field; a job id already submitted
        raises ValidationError on ``id`` unless ``idempotent`` (then the handle
        attaches to the existing job and nothing is enqueued).
        """
        data = {k: v for k, v in options.items() if v is not None}
        data.update(prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids)
        data["id"] = id if id is not None else new_job_id()
        job = validate_job(data, self.limits)
        return self.submit_request(job, queue=queue, idempotent=idempotent)

    @abstractmethod
    def submit_request(
        self, job: JobLike, *, queue: str | None, idempotent: bool, key_id: str | None = None
    ) -> SubmittedT:
        """Enqueue a ready JobRequest (or its dict); same rules as :meth:`submit`.

        ``key_id`` (the gateway's) is stored on the job's status hash, and an idempotent
        submit attaches only to a job of the same ``key_id``: another's raises
        ValidationError on ``id``, so no key can read or cancel another's job by id.
        """

    def coerce_request(self, job: JobLike) -> JobRequest:
        """A JobRequest (dict or model) validated against the limits, with an id."""
        data = dict(job) if isinstance(job, Mapping) else job.model_dump(exclude_none=True)
        data.setdefault("id", None)
        if data["id"] is None:
            data["id"] = new_job_id()
        if data.get("seed") is None and isinstance(data["id"], str):
            # Every job samples as if seeded, so a re-run continues the same text.
            data["seed"] = job_seed(data["id"])
        return validate_job(data, self.limits)

    def plan_submit(self, job: JobLike, queue: str | None, key_id: str | None = None) -> SubmitPlan:
        """The submit script call of a submit_request() call."""
        request = self.coerce_request(job)
        assert request.id is not None
        name = lane(self.queue_name(queue), request.priority)
        status = self.initial_status(name, key_id)
        return SubmitPlan.make(self.keys, request.id, name, encode_job(request), status)

    def plan_submit_many(
        self, jobs: Iterable[JobLike], queue: str | None, *, attach: bool
    ) -> SubmitManyCall:
        """The script calls of a submit_many() call, one per partition its jobs fall in;
        every job is validated (and given an id) before anything is sent. Raises
        ValidationError naming the job."""
        payloads: dict[str, bytes] = {}
        lowest = 1  # the priority lane when every job has priority > 0
        for index, job in enumerate(jobs):
            if len(payloads) == MAX_SUBMIT_MANY:
                raise ValidationError(
                    "jobs", f"more than {MAX_SUBMIT_MANY} jobs in one call; submit them in parts"
                )
            try:
                request = self.coerce_request(job)
            except ValidationError as exc:
                raise ValidationError(
                    exc.field, f"job {index} of the call: {exc.message}", value=exc.value
                ) from None
            job_id = str(request.id)
            if job_id in payloads:
                raise ValidationError("id", f"job {job_id} appears twice in one call", value=job_id)
            payloads[job_id] = encode_job(request)
            lowest = min(lowest, request.priority)
        if not payloads:
            raise ValidationError("jobs", "no job to submit")
        name = lane(self.queue_name(queue), lowest)
        status = self.initial_status(name)
        parts = [
            SubmitManyPlan.make(self.keys, group, name, status, attach=attach)
            for group in by_partition(self.keys, list(payloads.items()))
        ]
        return SubmitManyCall(list(payloads), name, parts, attach)

    def check_not_submitted(self, call: SubmitManyCall, held: list[Any]) -> None:
        """Raise ValidationError on ``id`` when a job of ``call`` exists (``held``: the
        HMGET of :attr:`SubmitManyCall.checked` of each job's status hash)."""
        clash = call.existing(held)
        if clash is not None:
            raise self.duplicate(*clash)

    def check_submitted_many(
        self, call: SubmitManyCall, replies: list[Any]
    ) -> list[tuple[str, str]]:
        """Each job's id and queue, in call order; raises ValidationError on ``id`` when a
        job existed before (its partition's script then wrote nothing: see
        :meth:`~batchd.producers.client.Client.submit_many` for the others')."""
        for index, (part, reply) in enumerate(zip(call.parts, replies, strict=True)):
            clash = part.clash(reply)
            if clash is not None:
                sent = [job_id for done in call.parts[:index] for job_id in done.job_ids]
                note = f"; the call's jobs of other partitions were queued: {sent}" if sent else ""
                raise self.duplicate(*clash, note=note)
        return [(job_id, call.queue) for job_id in call.job_ids]

    def check_submitted(
        self, plan: SubmitPlan, reply: Any, idempotent: bool, key_id: str | None = None
    ) -> tuple[str, str]:
        """The job id and queue of a submit that went through; raises ValidationError on
        ``id`` when the job existed before, unless ``idempotent`` and (for a ``key_id``)
        the job is that key's."""
        if plan.enqueued(reply):
            return plan.job_id, plan.queue
        if not idempotent:
            raise self.duplicate(plan.job_id, plan.existing_state(reply))
        if key_id is not None and plan.existing_key_id(reply) != key_id:
            raise ValidationError(
                "id", f"job {plan.job_id} exists and is not this key's", value=plan.job_id
            )
        return plan.job_id, plan.queue

    def check_replicated(self, acked: int | None, job_ids: list[str]) -> None:
        """Raise NotReplicated when ``replicas`` were asked and fewer confirmed."""
        if acked is not None and acked < self.replicas:
            raise NotReplicated(job_ids, acked, self.replicas)

    def queue_name(self, queue: str | None) -> str:
        return self.queue if queue is None else check_name("queue", queue)

    def initial_status(self, queue: str, key_id: str | None = None) -> dict[Any, Any]:
        status = JobStatus(state=JobState.queued, queue=queue, queued_at=now(), key_id=key_id)
        return status.to_hash()

    def duplicate(
        self, job_id: str, state: bytes | str | None, *, note: str = ""
    ) -> ValidationError:
        shown = state.decode() if isinstance(state, bytes) else state
        return ValidationError(
            "id",
            f"job {job_id} was already submitted (state {shown or 'unknown'}); "
            f"pass idempotent=True to attach to it{note}",
            value=job_id,
        )

    def cancel_made(self, plan: CancelPlan, reply: Any) -> bool:
        """Whether a cancel request went to a job that had not ended; raises JobNotFound."""
        state = plan.state(reply)
        if state is None:
            raise JobNotFound(plan.job_id)
        try:
            ended = JobState(state).terminal
        except ValueError:
            ended = False
        return not ended and plan.requested(reply)

    def parse_status(self, job_id: str, data: Mapping[Any, Any]) -> JobStatus:
        if not data:
            raise JobNotFound(job_id)
        return JobStatus.from_hash(dict(data))

    def follower(self, *, timeout: float | None = None) -> Follower:
        return Follower(
            self.keys,
            cluster=self.cluster,
            block_ms=self.block_ms,
            status_interval_s=self.block_ms / 1000,
            reconnect_timeout_s=self.reconnect_timeout_s,
            timeout=timeout,
            missing_timeout_s=self.missing_timeout_s,
        )


def _connection_kwargs(client: Any) -> Mapping[str, Any]:
    """The connection keywords of a given client: its pool's, or a cluster client's (sync:
    its nodes manager's; asyncio: its own)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return pool.connection_kwargs
    manager = getattr(client, "nodes_manager", None)
    return getattr(manager, "connection_kwargs", None) or client.connection_kwargs


ClientT = TypeVar("ClientT")


class HandleBase(Generic[ClientT]):
    """What a job handle holds, sync or async: its client, id and queue."""

    def __init__(self, client: ClientT, job_id: str, queue: str) -> None:
        self.client = client
        self.id = job_id
        self.queue = queue

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, queue={self.queue!r})"
