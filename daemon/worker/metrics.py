"""Running figures of a daemon: tokens/s, steps, batch sizes, jobs finished.

Read by the heartbeat (its figures) and the demo's summary. Updated on the
engine thread only.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from batchd.daemon.worker.jobs import Job
from batchd.engine.outputs import StepStats

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

    def step(self, stats: StepStats, num_tokens: int) -> None:
        now = self.clock()
        self.steps += 1
        self.tokens += num_tokens
        self.batch_sizes[stats.num_seqs] += 1
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

    def figures(self, stats: StepStats, **state: Any) -> dict[str, Any]:
        """The heartbeat's figures (batchd.producers.schema.DaemonHeartbeat): the engine's
        load after its last step, these counters, and the daemon's ``state`` (busy,
        last_step_at, jobs_held, redis_down, stopping, paused, draining)."""
        return {
            **state,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_usage": round(stats.kv_usage, 4),
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total,
            "tokens_per_s": round(self.tokens_per_s(), 1),
            "jobs_done": dict(self.jobs_finished),
        }
