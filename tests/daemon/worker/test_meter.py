"""The daemon's running figures: tokens/s over the last WINDOW_S seconds only."""

from __future__ import annotations

from batchd.daemon.worker.metrics import WINDOW_S, Meter
from batchd.engine.outputs import StepStats


def test_tokens_per_s_counts_the_window_only() -> None:
    now = [100.0]
    meter = Meter(clock=lambda: now[0])
    assert meter.tokens_per_s() == 0.0
    for _ in range(10):  # 10 steps of 32 tokens, 0.5 s apart
        meter.step(StepStats(step=1, num_seqs=32), 32)
        now[0] += 0.5
    assert meter.tokens_per_s() == 320 / 5.0
    now[0] += WINDOW_S - 2.0  # at 113 s: the steps before 103 s fall out of the window
    meter.step(StepStats(step=2, num_seqs=8), 8)
    assert meter.tokens_per_s() == (4 * 32 + 8) / (now[0] - 103.0)
    assert (meter.steps, meter.tokens) == (11, 328)
    assert meter.batch_sizes == {32: 10, 8: 1}
