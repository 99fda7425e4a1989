"""Time series the overview charts draw: a fixed number of recent samples per metric.

Kept in the dashboard's memory (no Prometheus server needed): a restarted dashboard
starts its charts afresh. One sample per refresh; ``None`` marks a gap (no daemon, no
job finished in the window), which a chart draws as a break, not as zero.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence


class History:
    """``points`` recent samples of every named series, all taken at the same times."""

    def __init__(self, points: int) -> None:
        self.points = points
        self.times: deque[float] = deque(maxlen=points)
        self.series: dict[str, deque[float | None]] = {}

    def add(self, at: float, **values: float | None) -> None:
        """One sample of every series (a series not given gets a gap)."""
        self.times.append(at)
        for name in set(self.series) | set(values):
            if name not in self.series:
                self.series[name] = deque([None] * (len(self.times) - 1), maxlen=self.points)
            self.series[name].append(values.get(name))

    def values(self, name: str) -> list[float | None]:
        return list(self.series.get(name, ()))

    def span_s(self) -> float:
        return self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
