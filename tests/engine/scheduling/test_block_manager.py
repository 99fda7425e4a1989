"""BlockManager: allocation, ref counts, the prefix-cache hash chain and LRU eviction."""

from __future__ import annotations

import pytest

from batchd.engine.scheduling.block_manager import BlockManager, chain_hash
from batchd.engine.scheduling.sequence import Sequence


def computed(bm: BlockManager, seq_id: str, tokens: list[int]) -> Sequence:
    """Admit a sequence (taking prefix hits), allocate all its tokens and mark them computed."""
    seq = Sequence(seq_id, tokens)
    bm.admit(seq, bm.match_prefix(seq))
    start = seq.num_computed_tokens
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq, start=start)
    bm.check_invariants()
    return seq


def test_grow_and_free_return_every_block() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = Sequence("a", list(range(9)))
    bm.admit(seq, [])
    bm.grow(seq, 9)
    assert seq.block_table == [0, 1, 2]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]
    bm.grow(seq, 12)  # still inside the third block
    assert seq.block_table == [0, 1, 2]
    bm.free(seq)
    bm.check_invariants()
    assert seq.block_table == []
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (0, 8, 0)


def test_grow_past_the_pool_raises() -> None:
    bm = BlockManager(2, 4)
    seq = Sequence("a", list(range(9)))
    bm.admit(seq, [])
    with pytest.raises(RuntimeError, match="a: needs 3 blocks, 2 free"):
        bm.grow(seq, 9)


def test_double_free_is_caught() -> None:
    bm = BlockManager(4, 4)
    seq = Sequence("a", [1, 2, 3])
    bm.admit(seq, [])
    bm.grow(seq, 3)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(seq)


def test_prefix_hit_shares_full_blocks_and_counts_refs() -> None:
    bm = BlockManager(16, 4)
    a = computed(bm, "a", list(range(10)))  # blocks: [0..3] [4..7] full, [8, 9] partial
    assert bm.num_cached_blocks == 2
    b = computed(bm, "b", list(range(8)) + [50, 51, 52])
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial block is never shared
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    assert bm.hit_tokens == 8 and bm.query_tokens == 10 + 11
    assert bm.hit_rate == pytest.approx(8 / 21)


def test_hit_never_covers_the_last_token() -> None:
    bm = BlockManager(16, 4)
    computed(bm, "a", list(range(12)))
    same = Sequence("b", list(range(12)))
    assert len(bm.match_prefix(same)) == 2  # the block holding the last token is computed
    shorter = Sequence("c", list(range(8)))
    assert len(bm.match_prefix(shorter)) == 1


def test_same_block_tokens_after_another_prefix_do_not_hit() -> None:
    bm = BlockManager(16, 4)
    computed(bm, "a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    other = Sequence("b", [9, 9, 9, 9, 2, 2, 2, 2, 0])
    assert bm.match_prefix(other) == []
    assert chain_hash(0, [1, 1, 1, 1]) != chain_hash(0, [9, 9, 9, 9])


def test_identical_content_computed_twice_stays_private() -> None:
    bm = BlockManager(16, 4)
    a, b = Sequence("a", list(range(5))), Sequence("b", list(range(5)))
    for seq in (a, b):  # both admitted before either block is computed
        bm.admit(seq, bm.match_prefix(seq))
        bm.grow(seq, 5)
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.register_full_blocks(seq, start=0)
    bm.check_invariants()
    assert bm.num_cached_blocks == 1
    assert bm.blocks[a.block_table[0]].hash is not None
    assert bm.blocks[b.block_table[0]].hash is None
    bm.free(b)
    assert bm.num_free_blocks == 16 - 2  # b's blocks went back as plain free blocks


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(6, 2)
    a = computed(bm, "a", [1, 1, 2, 2, 0])  # two cached blocks + one partial
    b = computed(bm, "b", [3, 3, 4, 4, 0])
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # the tail first: a1, then a0
    bm.free(b)
    bm.check_invariants()
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (6, 4)
    # Never-cached free blocks go first (the two partial blocks), then LRU order.
    c = Sequence("c", [7] * 11)
    bm.admit(c, [])
    bm.grow(c, 11)
    assert c.block_table == [
        a_blocks[2],
        b_blocks[2],
        a_blocks[1],
        a_blocks[0],
        b_blocks[1],
        b_blocks[0],
    ]
    assert bm.num_evictions == 4 and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_a_hit_refreshes_a_block_in_lru_order() -> None:
    bm = BlockManager(4, 2)
    a = computed(bm, "a", [1, 1, 0])
    b = computed(bm, "b", [2, 2, 0])
    a0, b0 = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    again = computed(bm, "a2", [1, 1, 5])  # hit on a0: it leaves the evictable list
    assert again.block_table[0] == a0 and bm.blocks[a0].ref_count == 1
    bm.free(again)  # a0 is now the most recently freed
    fresh = Sequence("c", [8] * 7)
    bm.admit(fresh, [])
    bm.grow(fresh, 6)
    assert b0 in fresh.block_table and a0 not in fresh.block_table
    assert len(bm.match_prefix(Sequence("a3", [1, 1, 9]))) == 1


def test_can_allocate_counts_reclaimed_cached_blocks() -> None:
    bm = BlockManager(3, 2)
    a = computed(bm, "a", [1, 1, 1, 1, 0])
    bm.free(a)
    seq = Sequence("b", [1, 1, 1, 1, 2, 2])
    hits = bm.match_prefix(seq)
    assert len(hits) == 2
    assert bm.can_allocate(1, reuse=hits)
    assert not bm.can_allocate(2, reuse=hits)


def test_prefix_caching_off_never_registers() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = computed(bm, "a", [1, 1, 2, 2, 3])
    assert bm.num_cached_blocks == 0
    b = computed(bm, "b", [1, 1, 2, 2, 3])
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
