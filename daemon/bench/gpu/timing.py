"""Device time of an MLX computation, for the GPU measurement scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx


def median_ms(run: Callable[[], object], *, repeats: int, warmups: int = 1) -> float:
    """The median of ``repeats`` timed evaluations of ``run()`` (milliseconds), after
    ``warmups`` untimed ones; the device is synchronized around each, so a call measures
    its own kernels and no earlier work still queued."""
    for _ in range(warmups):
        mx.eval(run())
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
