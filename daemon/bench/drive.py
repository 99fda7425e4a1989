"""Driving a step-wise generator: all requests at t=0, or on a timed arrival schedule.

batchd's engine and mlx-lm's BatchGenerator both advance one batched step
at a time; the same loop drives both, so they are timed the same way.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from batchd.daemon.bench.stats import Recorder, RunStats
from batchd.daemon.bench.workloads import Request, Workload


class StepSystem(Protocol):
    """A continuous batcher: requests go in, each step yields the tokens it made."""

    def add(self, request: Request) -> None: ...

    def step(self) -> list[tuple[str, int, bool]]:
        """One batched step: (request_id, new output tokens, finished) per request advanced."""
        ...

    def has_unfinished(self) -> bool: ...

    def close(self) -> None: ...


def _record(system: StepSystem, recorder: Recorder) -> None:
    for request_id, count, finished in system.step():
        recorder.token(request_id, count=count, finished=finished)


def run_offline(system: StepSystem, workload: Workload, recorder: Recorder) -> RunStats:
    """Every request arrives at once; step until all are done."""
    for request in workload.requests:
        recorder.arrive(request.request_id)
        system.add(request)
    while system.has_unfinished():
        _record(system, recorder)
    return recorder.result()


def run_timed(
    system: StepSystem, workload: Workload, arrivals: list[float], recorder: Recorder
) -> RunStats:
    """Requests arrive at ``arrivals`` (seconds from start); TTFT counts from those times.

    A request whose time passes during a step is added right after it, with
    its scheduled arrival time, so a long step shows up in its TTFT.
    """
    if len(arrivals) != len(workload.requests):
        raise ValueError(f"{len(arrivals)} arrival times for {len(workload.requests)} requests")
    pending = deque(zip(arrivals, workload.requests, strict=True))
    start = recorder.now()
    while pending or system.has_unfinished():
        now = recorder.now() - start
        while pending and pending[0][0] <= now:
            at, request = pending.popleft()
            recorder.arrive(request.request_id, at=start + at)
            system.add(request)
        if system.has_unfinished():
            _record(system, recorder)
        elif pending:
            time.sleep(max(0.0, pending[0][0] - now))
    return recorder.result()
