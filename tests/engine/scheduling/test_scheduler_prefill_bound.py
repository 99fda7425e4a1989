"""max_prefill_tokens_with_decodes: exact schedules with the prefill bound, which applies only
while some sequence decodes, is shared by continuing chunks and admissions, is raised to fill
the runner's row tile (prefill_fills_row_tile), and is validated."""

from __future__ import annotations

import pytest
from scheduler_harness import make_scheduler, seq, step

from batchd.config.settings import Settings
from batchd.engine.config import EngineConfig


def test_prefill_is_bounded_while_a_sequence_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_prefill_tokens_with_decodes=4)
    sched.add(seq("a", 2, max_tokens=8))
    assert step(sched) == [("a", 0, 2)]
    sched.add(seq("b", 10, max_tokens=2))
    # Without the bound b would go whole (10 of the 15 tokens left); with it, 4 per step.
    assert step(sched) == [("a", 2, 1), ("b", 0, 4)]
    assert step(sched) == [("a", 3, 1), ("b", 4, 4)]
    assert step(sched) == [("a", 4, 1), ("b", 8, 2)]
    assert step(sched) == [("a", 5, 1), ("b", 10, 1)]


def test_without_decodes_prefill_takes_the_whole_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_prefill_tokens_with_decodes=4)
    sched.add(seq("a", 10, max_tokens=4))
    sched.add(seq("b", 10, max_tokens=4))
    assert step(sched) == [("a", 0, 10), ("b", 0, 6)]
    # a now decodes, so b's last 4 tokens are all the prefill the step may carry.
    assert step(sched) == [("a", 10, 1), ("b", 6, 4)]
    assert step(sched) == [("a", 11, 1), ("b", 10, 1)]


def test_the_bound_is_shared_by_running_prefills_then_admissions() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, max_prefill_tokens_with_decodes=6)
    sched.add(seq("a", 2, max_tokens=8, at=0))
    assert step(sched) == [("a", 0, 2)]
    sched.add(seq("b", 10, max_tokens=2, at=1))
    sched.add(seq("c", 9, max_tokens=2, at=2))
    assert step(sched) == [("a", 2, 1), ("b", 0, 6)]
    # b (admitted first) continues with 4 tokens; c is admitted with the 2 left.
    assert step(sched) == [("a", 3, 1), ("b", 6, 4), ("c", 0, 2)]
    assert step(sched) == [("a", 4, 1), ("b", 10, 1), ("c", 2, 6)]
    assert step(sched) == [("a", 5, 1), ("c", 8, 1)]
    output = sched.schedule()
    assert (output.num_decodes, output.num_prefill_tokens) == (2, 0)


def test_a_bound_above_the_budget_changes_nothing() -> None:
    schedules = []
    for bound in (None, 64):
        sched = make_scheduler(max_num_batched_tokens=8, max_prefill_tokens_with_decodes=bound)
        sched.add(seq("a", 2, max_tokens=6, at=0))
        sched.add(seq("b", 20, max_tokens=2, at=1))
        schedules.append([step(sched) for _ in range(5)])
    assert schedules[0] == schedules[1]
    assert schedules[0][1] == [("a", 2, 1), ("b", 6, 7)]


def test_the_bound_is_raised_to_fill_the_row_tile() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, max_prefill_tokens_with_decodes=4, row_tile=8)
    sched.add(seq("a", 2, max_tokens=8, at=0))
    assert step(sched) == [("a", 0, 2)]
    sched.add(seq("b", 40, max_tokens=2, at=1))
    # 1 decode + 4 prefill rows reach the first tile of 8: prefill takes 7.
    assert step(sched) == [("a", 2, 1), ("b", 0, 7)]
    sched.add(seq("c", 2, max_tokens=8, at=2))
    sched.add(seq("d", 2, max_tokens=8, at=3))
    assert step(sched) == [("a", 3, 1), ("b", 7, 7)]
    assert step(sched) == [("a", 4, 1), ("b", 14, 7)]
    assert step(sched) == [("a", 5, 1), ("b", 21, 7)]
    assert step(sched) == [("a", 6, 1), ("b", 28, 7)]
    # b's last 5 tokens leave 2 for c and d's admission (2 tokens each, one gets them).
    assert step(sched) == [("a", 7, 1), ("b", 35, 5), ("c", 0, 2)]


def test_decodes_past_a_tile_fill_the_next_one() -> None:
    sched = make_scheduler(
        max_num_batched_tokens=64, max_num_seqs=8, max_prefill_tokens_with_decodes=4, row_tile=8
    )
    for i in range(6):
        sched.add(seq(f"d{i}", 1, max_tokens=8, at=i))
    assert [n for _, _, n in step(sched)] == [1] * 6
    sched.add(seq("p", 40, max_tokens=2, at=9))
    # 6 decodes + 4 prefill rows = 10: the second tile ends at 16, so prefill takes 10.
    assert step(sched)[-1] == ("p", 0, 10)


@pytest.mark.parametrize(
    ("row_tile", "fill", "expected"), [(8, False, 4), (1, True, 4), (6, True, 5)]
)
def test_the_bound_as_set_without_a_tile_to_fill(row_tile: int, fill: bool, expected: int) -> None:
    sched = make_scheduler(
        max_num_batched_tokens=32,
        max_prefill_tokens_with_decodes=4,
        prefill_fills_row_tile=fill,
        row_tile=row_tile,
    )
    sched.add(seq("a", 2, max_tokens=8))
    step(sched)
    sched.add(seq("b", 40, max_tokens=2))
    assert step(sched) == [("a", 2, 1), ("b", 0, expected)]


def test_a_runner_that_computes_just_the_rows_keeps_the_bound() -> None:
    """MLX's CPU products pad 4 rows and more to 16, fewer not at all: 1 decode + 2
    prefill rows stay 3; with a bound of 4 the padded 16 rows are filled."""
    for bound, expected in ((2, 2), (4, 15)):
        sched = make_scheduler(max_num_batched_tokens=32, max_prefill_tokens_with_decodes=bound)
        sched.computed_rows = lambda n: n if n < 4 else -(-n // 16) * 16
        sched.add(seq("a", 2, max_tokens=8))
        step(sched)
        sched.add(seq("b", 40, max_tokens=2))
        assert step(sched) == [("a", 2, 1), ("b", 0, expected)]


@pytest.mark.parametrize("bound", [0, -1, True, 2.5])
def test_bound_must_be_a_positive_int(bound: object) -> None:
    with pytest.raises(ValueError, match=r"max_prefill_tokens_with_decodes must be None or >= 1"):
        EngineConfig(max_prefill_tokens_with_decodes=bound)  # type: ignore[arg-type]


def test_bound_needs_chunked_prefill() -> None:
    with pytest.raises(ValueError, match=r"None when enable_chunked_prefill is off .*, got 32"):
        EngineConfig(max_prefill_tokens_with_decodes=32, enable_chunked_prefill=False)


def test_the_daemon_setting_reaches_the_engine_config() -> None:
    settings = Settings(engine={"max_prefill_tokens_with_decodes": 48})
    assert settings.engine.max_prefill_tokens_with_decodes == 48
    assert Settings().engine.max_prefill_tokens_with_decodes is None
    assert Settings(engine={"prefill_fills_row_tile": False}).engine.prefill_fills_row_tile is False
    assert Settings().engine.prefill_fills_row_tile is True
