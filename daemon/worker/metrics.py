"""Running figures of a daemon: tokens/s, steps, batch sizes, jobs finished.

Read by the heartbeat (tokens/s) and the demo's summary. Updated on the
engine thread only.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

from batchd.daemon.worker.generator import StepView
from batchd.daemon.worker.jobs import Job

WINDOW_S = 10.0


class Meter:
    """Counters since start, and output tokens/s over the last ``WINDOW_S`` seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.steps = 0
        self.tokens = 0
        self.jobs_finished: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()
        self._recent: deque[tuple[float, int]] = deque()
        # The tokens in ``_recent``, kept as it changes: read every loop turn.
        self._recent_tokens = 0

    def step(self, view: StepView | None, num_tokens: int) -> None:
        now = self.clock()
        self.steps += 1
        self.tokens += num_tokens
        if view is not None:
            self.batch_sizes[len(view.decodes) + len(view.prefills)] += 1
        self._recent.append((now, num_tokens))
        self._recent_tokens += num_tokens
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent_tokens -= self._recent.popleft()[1]

    def finished(self, job: Job) -> None:
        self.jobs_finished[job.finish_reason.value if job.finish_reason else "unknown"] += 1

    def tokens_per_s(self) -> float:
        if not self._recent:
            return 0.0
        span = max(self.clock() - self._recent[0][0], 1e-3)
        return self._recent_tokens / span
