"""A stand-in daemon that follows the wire protocol with canned tokens, in a thread.

It does what the real daemon does on the Redis side, without a model: reads
the queue stream through the consumer group, skips a job whose status hash
says it is no longer queued (idempotent enqueue), honours ``cancel_requested``
at pickup and cancel requests from the cancel stream while running, writes
each token with an explicit id ``0-<seq+1>`` plus a PUBLISH, then the final
event, the status hash, and XACK. All its running jobs advance one token per
step, every ``token_delay_s``. Token ``i`` is character ``i`` of the prompt
(cycled), so a job's text is predictable: :func:`expected_text`.

A prompt starting with ``!fail`` ends in an error after one token. On a
dropped connection (e.g. Redis restarted) it reconnects and resumes each job
at the seq after the last one its stream holds.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from producers.errors import ValidationError
from producers.keys import CANCEL_FIELD, CONSUMER_GROUP, EVENT_FIELD, JOB_FIELD, Keys, event_id
from producers.keys import seq_of as _seq_of
from producers.schema import (
    FINAL_STATE,
    Event,
    FinishReason,
    JobRequest,
    Timings,
    Usage,
    parse_job,
)


def prompt_text(job: JobRequest) -> str:
    if job.prompt is not None:
        return job.prompt or "x"
    if job.messages is not None:
        return job.messages[-1].content or "x"
    return "".join(chr(97 + t % 26) for t in job.prompt_token_ids or [0])


def expected_text(prompt: str, max_tokens: int) -> str:
    """The text the fake daemon generates for a plain prompt."""
    source = prompt or "x"
    return "".join(source[i % len(source)] for i in range(max_tokens))


@dataclass
class _Run:
    job: JobRequest
    entry_id: bytes
    queue: str
    seq: int = 0
    started: float = field(default_factory=time.time)
    first_token: float | None = None
    pieces: list[str] = field(default_factory=list)


class FakeDaemon:
    """Consumes ``queue`` until :meth:`stop`; records what it ran.

    ``started`` counts how many times each job id began generating (a job run
    twice shows 2); ``max_active`` is the most jobs it held at once;
    ``finished`` lists job ids in completion order.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "batchd",
        queue: str = "default",
        token_delay_s: float = 0.0,
        max_active: int = 64,
        consumer: str = "fake-daemon",
        result_ttl_s: int = 3600,
    ) -> None:
        self.url = url
        self.keys = Keys(prefix)
        self.queue = queue
        self.token_delay_s = token_delay_s
        self.max_active_allowed = max_active
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self.started: Counter[str] = Counter()
        self.finished: list[str] = []
        self.max_active = 0
        self.active: dict[str, _Run] = {}
        self._cancel_last = "0-0"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> FakeDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FakeDaemon:
        self._stop.clear()
        self._thread = threading.Thread(target=self._main, name="fake-daemon", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self.error is not None:
            raise RuntimeError("fake daemon failed") from self.error

    def _main(self) -> None:
        r = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=1)
        try:
            self._setup(r)
            while not self._stop.is_set():
                try:
                    self._intake(r)
                    self._control(r)
                    self._step(r)
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
                    self._resync(r)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
        finally:
            r.close()

    def _setup(self, r: redis.Redis) -> None:
        try:
            r.xgroup_create(self.keys.queue(self.queue), CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        last = r.xrevrange(self.keys.cancel, count=1)
        self._cancel_last = last[0][0].decode() if last else "0-0"

    def _resync(self, r: redis.Redis) -> None:
        """After a reconnect: continue each job after the last event its stream holds."""
        try:
            for job_id, run in list(self.active.items()):
                last = r.xrevrange(self.keys.events(job_id), count=1)
                run.seq = _seq_of(last[0][0]) + 1 if last else 0
                del run.pieces[run.seq :]
                final = Event.decode(last[0][1][EVENT_FIELD.encode()]) if last else None
                if final is not None and final.final:
                    self._settle(r, job_id, run, final)
        except (redis.ConnectionError, redis.TimeoutError):
            pass

    def _intake(self, r: redis.Redis) -> None:
        room = self.max_active_allowed - len(self.active)
        if room <= 0:
            return
        queue_key = self.keys.queue(self.queue)
        reply = r.xreadgroup(
            CONSUMER_GROUP,
            self.consumer,
            {queue_key: ">"},
            count=room,
            block=None if self.active else 50,
        )
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                self._admit(r, entry_id, fields[JOB_FIELD.encode()])
        self.max_active = max(self.max_active, len(self.active))

    def _admit(self, r: redis.Redis, entry_id: bytes, payload: bytes) -> None:
        queue_key = self.keys.queue(self.queue)
        try:
            job = parse_job(payload)
        except ValidationError:
            r.xack(queue_key, CONSUMER_GROUP, entry_id)
            return
        assert job.id is not None
        status = r.hgetall(self.keys.job(job.id))
        if status.get(b"state", b"queued") != b"queued":
            r.xack(queue_key, CONSUMER_GROUP, entry_id)
            return
        run = _Run(job, entry_id, self.queue)
        if status.get(b"cancel_requested") == b"1":
            self._finish(r, job.id, run, FinishReason.cancelled)
            return
        self.started[job.id] += 1
        self.active[job.id] = run
        r.hset(
            self.keys.job(job.id),
            mapping={"state": "running", "daemon": self.consumer, "started_at": str(run.started)},
        )

    def _control(self, r: redis.Redis) -> None:
        reply = r.xread({self.keys.cancel: self._cancel_last})
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                self._cancel_last = entry_id.decode()
                job_id = fields[CANCEL_FIELD.encode()].decode()
                run = self.active.get(job_id)
                if run is not None:
                    self._finish(r, job_id, run, FinishReason.cancelled)

    def _step(self, r: redis.Redis) -> None:
        if not self.active:
            return
        pipe = r.pipeline(transaction=False)
        ending: list[tuple[str, _Run, FinishReason]] = []
        for job_id, run in self.active.items():
            text = prompt_text(run.job)
            piece = text[run.seq % len(text)]
            event = Event(seq=run.seq, token_id=ord(piece), text=piece)
            pipe.xadd(self.keys.events(job_id), {EVENT_FIELD: event.encode()}, id=event_id(run.seq))
            pipe.publish(self.keys.tokens(job_id), event.encode())
            if run.first_token is None:
                run.first_token = time.time()
                pipe.hset(self.keys.job(job_id), "first_token_at", str(run.first_token))
            run.seq += 1
            run.pieces.append(piece)
            if text.startswith("!fail"):
                ending.append((job_id, run, FinishReason.error))
            elif run.seq >= run.job.max_tokens:
                ending.append((job_id, run, FinishReason.length))
        pipe.execute()
        for job_id, run, reason in ending:
            self._finish(r, job_id, run, reason)
        if self.token_delay_s:
            time.sleep(self.token_delay_s)

    def _finish(self, r: redis.Redis, job_id: str, run: _Run, reason: FinishReason) -> None:
        """Final event, then status, then XACK: each idempotent, in this order."""
        final = Event(
            seq=run.seq,
            finish_reason=reason,
            text="".join(run.pieces),
            usage=Usage(prompt_tokens=len(prompt_text(run.job)), completion_tokens=run.seq),
            timings=Timings(started=run.started, first_token=run.first_token, finished=time.time()),
            error="fake failure" if reason is FinishReason.error else None,
            metadata=run.job.metadata,
        )
        pipe = r.pipeline(transaction=False)
        pipe.xadd(self.keys.events(job_id), {EVENT_FIELD: final.encode()}, id=event_id(run.seq))
        pipe.publish(self.keys.tokens(job_id), final.encode())
        pipe.execute()
        self._settle(r, job_id, run, final)

    def _settle(self, r: redis.Redis, job_id: str, run: _Run, final: Event) -> None:
        assert final.finish_reason is not None
        status: dict[Any, Any] = {
            "state": FINAL_STATE[final.finish_reason].value,
            "finish_reason": final.finish_reason.value,
            "finished_at": str(time.time()),
            "completion_tokens": str(final.seq),
        }
        if final.error:
            status["error"] = final.error
        pipe = r.pipeline(transaction=False)
        pipe.hset(self.keys.job(job_id), mapping=status)
        pipe.expire(self.keys.events(job_id), self.result_ttl_s)
        pipe.expire(self.keys.job(job_id), self.result_ttl_s)
        pipe.xack(self.keys.queue(run.queue), CONSUMER_GROUP, run.entry_id)
        pipe.execute()
        self.active.pop(job_id, None)
        self.finished.append(job_id)
