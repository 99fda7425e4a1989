"""PublishCadence without Redis: which outboxes a publish carries, and when a pipeline is
settled at once or left in flight beside the next step."""

from __future__ import annotations

import threading
from typing import Any

from batchd.daemon.worker.cadence import OVERLAP_MIN_STEP_S, PublishCadence
from batchd.daemon.worker.jobs import Delivery, Job
from batchd.daemon.worker.publisher import FlushResult
from batchd.daemon.worker.redis_io import Backoff
from batchd.producers.schema import Event, FinishReason


class StubFlush:
    """A pipeline that records the thread it ran on."""

    def __init__(self) -> None:
        self.ran_on: str | None = None

    def execute(self) -> list[Any]:
        self.ran_on = threading.current_thread().name
        return ["replies"]


class StubPublisher:
    def __init__(self) -> None:
        self.flushes: list[StubFlush] = []
        self.settled: list[tuple[StubFlush, list[Any]]] = []

    def prepare(self, jobs: Any, extras: Any = ()) -> StubFlush:
        self.flushes.append(StubFlush())
        return self.flushes[-1]

    def settle(self, flush: StubFlush, replies: list[Any]) -> FlushResult:
        self.settled.append((flush, replies))
        return FlushResult(published_events=1)


def _cadence(*, steps_use_cpu: bool, interval_ms: int | None = None) -> tuple[Any, list[float]]:
    published: list[float] = []
    cadence = PublishCadence(
        StubPublisher(),  # type: ignore[arg-type]
        Backoff(cap_s=1.0),
        interval_ms=interval_ms,
        steps_use_cpu=steps_use_cpu,
        on_published=published.append,
    )
    return cadence, published


def _job(job_id: str, *, stored: int, unpublished: int = 0) -> Job:
    job = Job(job_id, Delivery("default", "1-0", {}))
    job.stored_events = stored
    job.unpublished = [Event(seq=stored + i, token_id=1) for i in range(unpublished)]
    return job


def test_between_full_publishes_only_urgent_outboxes_and_acks_go() -> None:
    cadence, _ = _cadence(steps_use_cpu=True)  # every 100 ms on the CPU
    assert cadence.interval_s == 0.1
    first = _job("first", stored=0, unpublished=1)  # its first token: someone waits on it
    middle = _job("middle", stored=5, unpublished=2)
    jobs = {"first": first, "middle": middle}
    assert list(cadence.due(jobs, working=True, backlog=False) or []) == [first, middle]
    # Within the interval: the urgent one only.
    assert cadence.due(jobs, working=True, backlog=False) == [first]
    first.stored_events, first.unpublished = 1, []
    assert cadence.due(jobs, working=True, backlog=False) is None
    # Nothing to step: everything goes now.
    assert list(cadence.due(jobs, working=False, backlog=False) or []) == [first, middle]
    # An ack alone waits for the interval, unless entries wait for the room it frees.
    done = _job("done", stored=3)
    done.finish_reason = FinishReason.stop  # its final event and status are stored
    jobs = {"middle": middle, "done": done}
    assert cadence.due(jobs, working=True, backlog=False) is None
    assert cadence.due(jobs, working=True, backlog=True) == [done]


def test_a_long_step_off_the_cpu_runs_beside_its_pipeline() -> None:
    cadence, published = _cadence(steps_use_cpu=False)
    assert cadence.interval_s == 0.0
    short = cadence.send([], [], step_s=OVERLAP_MIN_STEP_S / 2)
    assert short is not None and not cadence.in_flight  # settled at once
    assert cadence.publisher.flushes[0].ran_on == threading.current_thread().name
    assert cadence.send([], [], step_s=OVERLAP_MIN_STEP_S) is None
    assert cadence.in_flight
    result = cadence.settle()
    assert result is not None and result.published_events == 1 and not cadence.in_flight
    assert cadence.publisher.flushes[1].ran_on.startswith("batchd-publish")
    assert cadence.settle() is None and len(published) == 2
    cadence.close()


def test_on_the_cpu_every_pipeline_is_settled_at_once() -> None:
    cadence, published = _cadence(steps_use_cpu=True)
    assert cadence.send([], [], step_s=1.0) is not None
    assert not cadence.in_flight and len(published) == 1
    cadence.close()
