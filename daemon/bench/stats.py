"""Token timestamps per request, and the figures drawn from them.

Only output tokens count (as ``vllm bench serve`` counts them): prompt
tokens are work, not output. TTFT runs from a request's arrival to its first
output token; inter-token latency is the gap between consecutive tokens of
one request.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from batchd.engine.outputs import StepStats


@dataclass
class RequestTiming:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finished: bool = False


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), or 0.0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0


class Recorder:
    """Collects arrival, token and finish times of one system's run.

    Times are seconds from the recorder's creation (``time.perf_counter``).
    ``on_finish(done, total)`` is called as requests finish, for progress.
    """

    def __init__(self, *, total: int, on_finish: Callable[[int, int], None] | None = None) -> None:
        self._t0 = time.perf_counter()
        self._total = total
        self._on_finish = on_finish
        self._done = 0
        self.requests: dict[str, RequestTiming] = {}

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def arrive(self, request_id: str, at: float | None = None) -> None:
        self.requests[request_id] = RequestTiming(arrival=self.now() if at is None else at)

    def token(self, request_id: str, *, count: int = 1, finished: bool = False) -> None:
        timing = self.requests[request_id]
        now = self.now()
        timing.token_times.extend([now] * count)
        if finished and not timing.finished:
            timing.finished = True
            self._done += 1
            if self._on_finish is not None:
                self._on_finish(self._done, self._total)

    def result(self) -> RunStats:
        """The figures of the run so far; wall time ends at the last token."""
        ends = [t.token_times[-1] for t in self.requests.values() if t.token_times]
        starts = [t.arrival for t in self.requests.values()]
        wall = (max(ends) - min(starts)) if ends else 0.0
        ttft = [t.token_times[0] - t.arrival for t in self.requests.values() if t.token_times]
        itl = [
            later - earlier
            for t in self.requests.values()
            for earlier, later in pairwise(t.token_times)
        ]
        return RunStats(
            requests=len(self.requests),
            finished=sum(t.finished for t in self.requests.values()),
            output_tokens=sum(len(t.token_times) for t in self.requests.values()),
            wall_s=wall,
            ttft_s=ttft,
            itl_s=itl,
        )


def step_profile(steps: Sequence[StepStats]) -> dict[str, Any]:
    """Step times weighted by the decodes each one holds up (one inter-token gap per decode).

    Split by steps that carry prefill and steps that do not: the decode-only
    steps' p99 / p50 is what ITL p99 / p50 would be with no prefill at all
    (batch sizes that change, and the machine's own jitter), the part of the
    ITL spread that a prefill bound cannot remove. The decode-only steps of the
    commonest batch size do the same work but for their contexts' growth, so
    their spread is the machine's jitter alone.
    """
    decode_only = [s for s in steps if s.num_decode_tokens and not s.num_prefill_tokens]
    with_prefill = [s for s in steps if s.num_decode_tokens and s.num_prefill_tokens]
    sizes = Counter(s.num_decode_tokens for s in decode_only).most_common(1)
    same_batch = sizes[0][0] if sizes else 0
    same_times = [s.step_time_s for s in decode_only if s.num_decode_tokens == same_batch]

    def weighted(part: Sequence[StepStats], q: float) -> float:
        return percentile([s.step_time_s for s in part for _ in range(s.num_decode_tokens)], q)

    gaps = sum(s.num_decode_tokens for s in steps)
    return {
        "steps": len(steps),
        "steps_with_prefill": len(with_prefill),
        "gap_share_with_prefill": round(sum(s.num_decode_tokens for s in with_prefill) / gaps, 4)
        if gaps
        else 0.0,
        "step_p50_s": round(weighted(steps, 50), 5),
        "step_p99_s": round(weighted(steps, 99), 5),
        "decode_only_p50_s": round(weighted(decode_only, 50), 5),
        "decode_only_p99_s": round(weighted(decode_only, 99), 5),
        "with_prefill_p50_s": round(weighted(with_prefill, 50), 5),
        "with_prefill_p99_s": round(weighted(with_prefill, 99), 5),
        "same_batch_decodes": same_batch,
        "same_batch_steps": len(same_times),
        "same_batch_p50_s": round(percentile(same_times, 50), 5),
        "same_batch_p99_s": round(percentile(same_times, 99), 5),
        # Per step: host work done while the device computed (hidden under it), and time
        # then spent waiting for the device (the step's one sync).
        "host_hidden_p50_s": round(percentile([s.host_overlap_s for s in steps], 50), 6),
        "device_wait_p50_s": round(percentile([s.sync_wait_s for s in steps], 50), 6),
    }


@dataclass
class RunStats:
    """One system's run of one workload; ``engine_steps`` when the system reports its steps."""

    requests: int
    finished: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float]
    itl_s: list[float]
    engine_steps: dict[str, Any] | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The JSON figures: throughput, TTFT and ITL percentiles, raw TTFTs for the chart."""
        figures: dict[str, Any] = {
            "requests": self.requests,
            "finished": self.finished,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 4),
            "tok_s": round(self.tok_s, 2),
            "ttft_p50_s": round(percentile(self.ttft_s, 50), 4),
            "ttft_p99_s": round(percentile(self.ttft_s, 99), 4),
            "itl_p50_s": round(percentile(self.itl_s, 50), 5),
            "itl_p99_s": round(percentile(self.itl_s, 99), 5),
            "ttft_s": [round(t, 4) for t in self.ttft_s],
        }
        if self.engine_steps is not None:
            figures["engine_steps"] = self.engine_steps
        return figures
