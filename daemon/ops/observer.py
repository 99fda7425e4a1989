"""The loop's single window to the outside: supervisor, metrics, lifecycle log lines.

The worker calls these hooks on its engine thread; each is cheap when its
part is off (no systemd, no metrics port). Log lines carry ``event`` and
``job_id`` fields (``--log-format json`` makes them searchable): one line when
a job starts and one when it ends, never one per token.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from batchd.config.settings import Settings
from batchd.daemon.ops.notify import Notifier
from batchd.daemon.ops.supervisor import Supervisor
from batchd.daemon.worker.generator import Generator
from batchd.daemon.worker.jobs import Job
from batchd.daemon.worker.metrics import Meter
from batchd.daemon.worker.redis_io import Backoff
from batchd.engine.outputs import RequestOutput, StepStats
from batchd.producers.schema import FINAL_STATE, FinishReason

log = logging.getLogger("batchd.daemon.jobs")


@dataclass(frozen=True)
class StepDone:
    """An engine step as the observers see it; ``jobs`` have not taken its tokens yet."""

    stats: StepStats
    outputs: list[RequestOutput]
    seconds: float
    jobs: Mapping[str, Job]


class WorkerState(Protocol):
    """What the hooks read of the worker, once per loop turn."""

    gen: Generator
    backoff: Backoff
    meter: Meter
    queues: list[str]

    @property
    def held(self) -> Mapping[str, Job]: ...


class Metrics(Protocol):
    """The Prometheus series (batchd.daemon.ops.prom.DaemonMetrics, imported only when
    metrics are on, with prometheus-client)."""

    def started(self) -> None: ...

    def stepped(self, step: StepDone) -> None: ...

    def published(self, seconds: float) -> None: ...

    def finished(self, job: Job) -> None: ...

    def tick(self, stats: StepStats, jobs: Mapping[str, Job], backoff: Backoff) -> None: ...


class Ops:
    """Hooks of the worker loop. ``Ops()`` only logs; the service adds the rest."""

    def __init__(
        self,
        *,
        model: str | None = None,
        supervisor: Supervisor | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.model = model
        self.supervisor = supervisor or Supervisor(Notifier(None), watchdog_s=None)
        self.metrics = metrics

    @classmethod
    def for_service(cls, settings: Settings, *, metrics: Metrics | None) -> Ops:
        """Ops of ``batchd serve``: systemd from the environment, metrics if on."""
        return cls(model=settings.model, supervisor=Supervisor.from_env(), metrics=metrics)

    def ready(self, worker: WorkerState) -> None:
        self.supervisor.ready(self._status(worker))

    def started(self, job: Job) -> None:
        log.info(
            "job %s started",
            job.job_id,
            extra={
                "event": "job_started",
                "queue": job.delivery.queue,
                "prompt_tokens": len(job.prompt_token_ids),
                "resumed_at_seq": job.next_seq,
                "deliveries": job.delivery.deliveries,
            },
        )
        if self.metrics is not None:
            self.metrics.started()

    def stepped(self, step: StepDone) -> None:
        if self.metrics is not None:
            self.metrics.stepped(step)

    def published(self, seconds: float) -> None:
        """One publish took ``seconds`` of the engine thread: building the pipeline,
        waiting for Redis's replies where it waits, applying them."""
        if self.metrics is not None:
            self.metrics.published(seconds)

    def finished(self, job: Job) -> None:
        """The job's final event, status and ack are stored."""
        reason = job.finish_reason or FinishReason.error
        failed = reason is FinishReason.error
        t = job.timings
        log.log(
            logging.WARNING if failed else logging.INFO,
            "job %s %s (%s): %d token(s)%s",
            job.job_id,
            FINAL_STATE[reason].value,
            reason.value,
            len(job.output_token_ids),
            f": {job.error}" if job.error else "",
            extra={
                "event": "job_failed" if failed else "job_finished",
                "state": FINAL_STATE[reason].value,
                "finish_reason": reason.value,
                "error": job.error,
                "prompt_tokens": len(job.prompt_token_ids),
                "completion_tokens": len(job.output_token_ids),
                "queued_s": _span(t.queued, t.started),
                "ttft_s": _span(t.queued, t.first_token),
                "duration_s": _span(t.started, t.finished),
            },
        )
        if self.metrics is not None:
            self.metrics.finished(job)

    def tick(self, worker: WorkerState) -> None:
        """Once per loop turn: the watchdog ping and status line, the gauges."""
        self.supervisor.alive(lambda: self._status(worker))
        if self.metrics is not None:
            self.metrics.tick(worker.gen.stats(), worker.held, worker.backoff)

    def stopping(self, jobs: Mapping[str, Job]) -> None:
        self.supervisor.stopping(f"stopping: {len(jobs)} job(s) finishing")

    def failed(self, exc: BaseException) -> None:
        """The loop died of ``exc``; the process exits non-zero next."""
        self.supervisor.failed(f"{type(exc).__name__}: {exc}")

    def _status(self, worker: WorkerState) -> str:
        stats = worker.gen.stats()
        redis = "redis unreachable, " if worker.backoff.down else ""
        return (
            f"{self.model or 'model'} on {','.join(worker.queues)}: {redis}"
            f"{stats.num_running} running, {stats.num_waiting} waiting, "
            f"{worker.meter.tokens_per_s():.0f} tokens/s, KV {stats.kv_usage:.0%}"
        )


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(max(0.0, end - start), 4)
