"""Sliding window: blocks wholly before every layer's window go back to the pool, the prefix
cache keeps them, and a model with a full-attention layer (no window) keeps every block."""

from __future__ import annotations

from scheduler_harness import FakeClock, expected_outputs, sampled_for, seq

from batchd.engine.config import EngineConfig
from batchd.engine.scheduling.block_manager import RELEASED, BlockManager
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import FinishReason, Sequence

BLOCK = 4
WINDOW = 6


def _scheduler(num_blocks: int, *, window: int | None, **options: object) -> Scheduler:
    config = EngineConfig(
        **{"aging_rate": 0.0, "max_num_seqs": 4, "block_size": BLOCK, **options}  # type: ignore[arg-type]
    )
    return Scheduler(
        config, num_blocks=num_blocks, max_model_len=1024, kv_window=window, clock=FakeClock()
    )


def _check_tables(sched: Scheduler, running: list[Sequence]) -> None:
    """Every running table: RELEASED exactly before its next token's window, live after;
    the pool's reference counts equal the live entries of all tables."""
    bm = sched.block_manager
    bm.check_invariants()
    refs = 0
    for s in running:
        if not s.is_running:
            continue
        window = bm.window
        passed = 0 if window is None else max(0, (s.num_computed_tokens - window + 1) // BLOCK)
        table = s.block_table
        assert all(b == RELEASED for b in table[:passed]), (s, passed)
        assert all(b != RELEASED for b in table[passed:]), (s, passed)
        refs += len(table) - min(passed, len(table))
    assert refs == sum(b.ref_count for b in bm.blocks)


def _run(sched: Scheduler, seqs: list[Sequence], limit: int = 500) -> None:
    for s in seqs:
        sched.add(s)
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        output = sched.schedule()
        sched.update(output, sampled_for(output))
        _check_tables(sched, seqs)
        for chunk in output.chunks:
            s = chunk.seq
            if chunk.samples and s.num_output_tokens == s.params.max_tokens:
                sched.finish(s.seq_id, FinishReason.length)
    raise AssertionError("sequences did not finish")


def _long_generations() -> list[Sequence]:
    # Each needs ceil((10 + 30 - 1) / 4) = 10 blocks without a window.
    return [seq(f"s{i}", list(range(10 * i, 10 * i + 10)), max_tokens=30) for i in range(3)]


def test_window_returns_passed_blocks_so_long_generations_share_a_small_pool() -> None:
    sched = _scheduler(12, window=WINDOW, max_num_batched_tokens=8)
    seqs = _long_generations()
    _run(sched, seqs)
    assert sched.num_preemptions == 0
    assert sched.block_manager.num_window_releases >= 3 * 7
    assert [s.output_token_ids for s in seqs] == [expected_outputs(s) for s in seqs]
    assert sched.block_manager.num_free_blocks == 12


def test_without_a_window_the_same_requests_preempt() -> None:
    sched = _scheduler(12, window=None, max_num_batched_tokens=8)
    _run(sched, _long_generations())
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_window_releases == 0


def test_chunked_prefill_releases_what_a_chunk_passed() -> None:
    sched = _scheduler(32, window=WINDOW, max_num_batched_tokens=9)
    s = seq("a", 40, max_tokens=3)
    sched.add(s)
    output = sched.schedule()
    sched.update(output, sampled_for(output))
    # 9 tokens computed: position 9 sees 4..9, so block 0 (positions 0..3) is passed.
    assert s.num_computed_tokens == 9 and s.block_table[0] == RELEASED
    assert s.block_table[1] != RELEASED
    _check_tables(sched, [s])


def test_released_blocks_stay_in_the_prefix_cache() -> None:
    sched = _scheduler(32, window=WINDOW, max_num_batched_tokens=64)
    first = seq("a", 17, max_tokens=8)
    sched.add(first)
    output = sched.schedule()
    blocks = list(first.block_table[:4])
    sched.update(output, sampled_for(output))
    assert first.block_table[:3] == [RELEASED] * 3  # position 17 sees 12..17
    bm = sched.block_manager
    # A later request with the same prompt finds all four full blocks, released ones too.
    second = seq("b", 17, max_tokens=2)
    assert bm.match_prefix(second) == blocks
    sched.add(second)
    output = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in output.chunks] == [
        ("a", 17, 1),
        ("b", 16, 1),
    ]
    sched.update(output, sampled_for(output))
    _check_tables(sched, [first, second])


def test_release_passed_without_window_keeps_every_block() -> None:
    bm = BlockManager(8, BLOCK)
    s = seq("a", 20)
    bm.admit(s, [])
    bm.grow(s, 20)
    s.num_computed_tokens = 20
    bm.release_passed(s)
    assert RELEASED not in s.block_table and bm.num_free_blocks == 3
