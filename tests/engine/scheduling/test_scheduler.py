"""Scheduler: exact schedules for the policies (decode first, chunking, prefix hits, LRU,
preemption, abort, admission limits, priorities) and add-time rejection messages."""

from __future__ import annotations

import pytest
from scheduler_harness import FakeClock, expected_outputs, make_scheduler, sampled_for, seq, step

from batchd.engine.exceptions import RequestRejected
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import FinishReason, SequenceStatus


def run_to_end(sched: Scheduler, limit: int = 100) -> list[list[tuple[str, int, int]]]:
    steps = []
    while sched.has_unfinished():
        steps.append(step(sched))
        assert len(steps) < limit
    return steps


def test_decodes_come_before_prefill_chunks() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8, block_size=4)
    sched.add(seq("a", 3, max_tokens=5))
    assert step(sched) == [("a", 0, 3)]
    sched.add(seq("b", 20))
    output = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in output.chunks] == [
        ("a", 3, 1),
        ("b", 0, 7),
    ]
    assert [c.is_decode for c in output.chunks] == [True, False]
    assert (output.num_decodes, output.num_prefill_tokens, output.num_batched_tokens) == (1, 7, 8)
    assert [c.samples for c in output.chunks] == [True, False]


def test_long_prompt_is_chunked_while_others_decode() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8, block_size=4)
    sched.add(seq("a", 2, max_tokens=10, at=0))
    sched.add(seq("b", 20, max_tokens=2, at=1))
    assert step(sched) == [("a", 0, 2), ("b", 0, 6)]
    sched.add(seq("c", 2, max_tokens=2, at=2))
    # b's prefill continues before c is admitted, while a keeps decoding.
    assert step(sched) == [("a", 2, 1), ("b", 6, 7)]
    assert step(sched) == [("a", 3, 1), ("b", 13, 7)]
    assert step(sched) == [("a", 4, 1), ("b", 20, 1), ("c", 0, 2)]
    assert sched.get("b") is None  # finished with 2 tokens
    assert step(sched) == [("a", 5, 1), ("c", 2, 1)]


def test_chunk_slots_follow_the_block_table() -> None:
    sched = make_scheduler(block_size=4)
    sched.add(seq("a", [7, 8, 9, 10, 11, 12]))
    output = sched.schedule()
    (chunk,) = output.chunks
    table = chunk.seq.block_table
    assert chunk.slots == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert chunk.token_ids == [7, 8, 9, 10, 11, 12] and chunk.positions == range(6)
    sched.update(output, sampled_for(output))
    (decode,) = sched.schedule().chunks
    assert decode.slots == [table[1] * 4 + 2] and decode.token_ids == [chunk.seq.last_token]


def test_prefix_cache_hit_skips_the_shared_blocks() -> None:
    sched = make_scheduler(block_size=4)
    system = list(range(10, 18))
    sched.add(seq("a", system + [1, 2, 3], max_tokens=4))
    assert step(sched) == [("a", 0, 11)]
    b = seq("b", system + [4, 5], max_tokens=2)
    sched.add(b)
    assert step(sched) == [("a", 11, 1), ("b", 8, 2)]
    a = sched.get("a")
    assert a is not None
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    bm = sched.block_manager
    assert [bm.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    stats = sched.stats()
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_query_tokens"]) == (8, 21)
    run_to_end(sched)
    # Finished sequences leave their full blocks cached for later requests.
    sched.add(seq("c", system + [9], max_tokens=1))
    assert step(sched) == [("c", 8, 1)]


def test_freed_prefixes_are_evicted_least_recently_used_first() -> None:
    sched = make_scheduler(num_blocks=6, block_size=2)
    for seq_id, prompt in (("a", [1, 1, 2, 2, 3]), ("b", [5, 5, 6, 6, 7]), ("c", [9] * 7)):
        sched.add(seq(seq_id, prompt, max_tokens=1))
        assert step(sched) == [(seq_id, 0, len(prompt))]
    # c needed 4 blocks: 2 never-cached ones, then evicted a's cached blocks (freed before b's).
    assert sched.block_manager.num_evictions == 2
    e, d = seq("e", [5, 5, 6, 6, 8], max_tokens=1), seq("d", [1, 1, 2, 2, 8], max_tokens=1)
    sched.add(e)
    sched.add(d)
    assert step(sched) == [("e", 4, 1), ("d", 0, 5)]
    assert (e.num_cached_tokens, d.num_cached_tokens) == (4, 0)


def test_preemption_picks_lowest_priority_newest_and_the_victim_completes_intact() -> None:
    sched = make_scheduler(num_blocks=7, block_size=2, max_num_seqs=3, max_num_batched_tokens=16)
    lo1 = seq("lo1", [4, 5, 6], max_tokens=4, at=0)
    lo2 = seq("lo2", [7, 8, 9], max_tokens=4, at=1)
    hi = seq("hi", [1, 2, 3], max_tokens=4, priority=1, at=2)
    for s in (lo1, lo2, hi):
        sched.add(s)
    assert step(sched) == [("hi", 0, 3), ("lo1", 0, 3), ("lo2", 0, 3)]
    sched.add(seq("lo3", [10, 11, 12], max_tokens=1, at=3))  # waits: three are running
    assert step(sched) == [("hi", 3, 1), ("lo1", 3, 1), ("lo2", 3, 1)]
    output = sched.schedule()  # position 4 needs a third block each; one is free
    assert [(c.seq.seq_id, c.start) for c in output.chunks] == [("hi", 4), ("lo1", 4)]
    assert output.preempted == [lo2]
    assert lo2.status is SequenceStatus.preempted and lo2.block_table == []
    assert (lo2.num_computed_tokens, lo2.output_token_ids) == (0, expected_outputs(lo2))
    sched.update(output, sampled_for(output))
    assert step(sched) == [("hi", 5, 1), ("lo1", 5, 1)]  # lo2 does not fit yet; lo3 waits behind
    # lo2 went back ahead of lo3 (same priority) and reuses its still-cached first block.
    assert step(sched) == [("lo2", 2, 3), ("lo3", 0, 3)]
    assert lo2.num_cached_tokens == 2
    run_to_end(sched)
    assert lo2.finish_reason is FinishReason.length
    assert lo2.output_token_ids == expected_outputs(lo2) and lo2.num_output_tokens == 4
    assert sched.stats()["num_preemptions"] == 1


def test_lowest_ranked_sequence_short_of_a_block_yields_itself() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    lo = seq("lo", [5, 6], max_tokens=3, at=0)
    sched.add(lo)
    sched.add(seq("hi", [1, 2, 3, 4], max_tokens=2, priority=1, at=1))
    assert step(sched) == [("hi", 0, 4), ("lo", 0, 2)]
    output = sched.schedule()
    assert [(c.seq.seq_id, c.start) for c in output.chunks] == [("hi", 4)]
    assert output.preempted == [lo]
    sched.update(output, sampled_for(output))
    sched.finish("hi", FinishReason.stop)
    assert step(sched) == [("lo", 2, 1)]
    run_to_end(sched)
    assert lo.output_token_ids == expected_outputs(lo)


def test_without_preemption_admission_reserves_the_worst_case() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2, enable_preemption=False)
    sched.add(seq("a", [1, 2, 3], max_tokens=4))
    sched.add(seq("b", [4, 5, 6], max_tokens=4))
    steps = run_to_end(sched)
    assert steps == [
        [("a", 0, 3)],
        [("a", 3, 1)],
        [("a", 4, 1)],
        [("a", 5, 1)],
        [("b", 0, 3)],
        [("b", 3, 1)],
        [("b", 4, 1)],
        [("b", 5, 1)],
    ]
    assert sched.stats()["num_preemptions"] == 0
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    sched.add(seq("a", [1, 2, 3], max_tokens=4))
    sched.add(seq("b", [4, 5, 6], max_tokens=4))
    assert step(sched) == [("a", 0, 3), ("b", 0, 3)]


def test_unchunked_prompt_waits_for_a_whole_step_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4, enable_chunked_prefill=False)
    sched.add(seq("a", 2, max_tokens=3))
    assert step(sched) == [("a", 0, 2)]
    sched.add(seq("b", 8, max_tokens=1))
    assert step(sched) == [("a", 2, 1)]  # 7 tokens of budget left: b goes whole or not at all
    assert step(sched) == [("a", 3, 1)]
    assert step(sched) == [("b", 0, 8)]


def test_running_cap_holds_back_admission() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for seq_id in "abc":
        sched.add(seq(seq_id, [ord(seq_id)], max_tokens=2))
    assert step(sched) == [("a", 0, 1), ("b", 0, 1)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert step(sched) == [("a", 1, 1), ("b", 1, 1)]
    assert step(sched) == [("c", 0, 1)]


def test_priority_first_then_fifo() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(seq("a", 2, max_tokens=1, at=0))
    sched.add(seq("b", [1, 2], max_tokens=1, priority=2, at=1))
    sched.add(seq("c", [3, 4], max_tokens=1, priority=2, at=2))
    assert [step(sched) for _ in range(3)] == [[("b", 0, 2)], [("c", 0, 2)], [("a", 0, 2)]]


def test_aging_lets_an_old_low_priority_request_go_first() -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, aging_rate=0.5, clock=clock)
    old, new = seq("old", [1], max_tokens=1, at=0), seq("new", [2], max_tokens=1, priority=2, at=5)
    sched.add(old)
    sched.add(new)
    clock.now = 10.0
    assert (sched.effective_priority(old), sched.effective_priority(new)) == (5.0, 4.5)
    assert sched.stats()["oldest_wait_s"] == 10.0
    assert [step(sched) for _ in range(2)] == [[("old", 0, 1)], [("new", 0, 1)]]
    slow = make_scheduler(max_num_seqs=1, aging_rate=0.1)
    slow.add(seq("old", [1], max_tokens=1, at=0))
    slow.add(seq("new", [2], max_tokens=1, priority=2, at=5))
    assert [step(slow) for _ in range(2)] == [[("new", 0, 1)], [("old", 0, 1)]]


def test_abort_in_each_state_frees_at_once() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8, block_size=4)
    bm = sched.block_manager
    sched.add(seq("waiting", 3))
    aborted = sched.abort("waiting")
    assert aborted is not None and aborted.status is SequenceStatus.finished
    assert aborted.finish_reason is FinishReason.abort
    assert (sched.get("waiting"), sched.num_waiting, sched.has_unfinished()) == (None, 0, False)

    sched.add(seq("prefilling", 20))
    assert step(sched) == [("prefilling", 0, 8)]
    assert bm.num_used_blocks == 2
    sched.abort("prefilling")
    assert (bm.num_used_blocks, sched.num_running) == (0, 0)

    system = list(range(8))
    sched.add(seq("x", system + [1]))
    step(sched)
    y = seq("y", system + [2])
    sched.add(y)
    step(sched)
    assert [bm.blocks[b].ref_count for b in y.block_table] == [2, 2, 1]
    sched.abort("x")  # decoding, sharing two blocks with y
    assert bm.num_used_blocks == len(y.block_table) == 3
    assert [bm.blocks[b].ref_count for b in y.block_table] == [1, 1, 1]
    sched.abort("y")
    assert bm.num_used_blocks == 0
    bm.check_invariants()
    assert sched.abort("nobody") is None
    with pytest.raises(KeyError, match="nobody"):
        sched.finish("nobody", FinishReason.stop)


def test_abort_of_a_preempted_sequence_and_between_schedule_and_update() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(seq("lo", [5, 6], max_tokens=3, at=0))
    sched.add(seq("hi", [1, 2, 3, 4], max_tokens=3, priority=1, at=1))
    step(sched)
    output = sched.schedule()
    assert [s.seq_id for s in output.preempted] == ["lo"]
    assert sched.abort("lo") is not None
    assert sched.num_waiting == 0
    sched.abort("hi")  # after schedule(), before update(): its chunk is ignored
    sched.update(output, {})
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()


def test_add_time_rejections_say_why() -> None:
    sched = make_scheduler(
        num_blocks=4,
        block_size=4,
        max_model_len=32,
        max_num_batched_tokens=8,
        enable_chunked_prefill=False,
    )
    cases = {
        "r1": (
            30,
            4,
            "request 'r1': prompt (30 tokens) + max_tokens (4) = 34 exceeds max_model_len 32",
        ),
        "r2": (
            16,
            4,
            "request 'r2': prompt (16 tokens) + max_tokens (4) needs 5 KV blocks of "
            "4 tokens, the pool has 4",
        ),
        "r3": (
            9,
            2,
            "request 'r3': prompt (9 tokens) exceeds max_num_batched_tokens 8 and "
            "chunked prefill is off",
        ),
    }
    for seq_id, (prompt, max_tokens, message) in cases.items():
        with pytest.raises(RequestRejected) as info:
            sched.add(seq(seq_id, prompt, max_tokens=max_tokens))
        assert str(info.value) == message
        assert isinstance(info.value, ValueError)
    sched.add(seq("fits", 8, max_tokens=9))  # 16 positions need K/V: the last token never does
    with pytest.raises(ValueError, match="'fits' is already waiting or running"):
        sched.add(seq("fits", 1))
    assert sched.num_waiting == 1


def test_update_checks_what_it_is_given() -> None:
    sched = make_scheduler()
    sched.add(seq("a", 3))
    output = sched.schedule()
    with pytest.raises(ValueError, match=r"sampled ids \[\]: the sampling chunks are \['a'\]"):
        sched.update(output, {})
    with pytest.raises(ValueError, match="sampled ids"):
        sched.update(output, {"a": 1, "ghost": 2})
    sched.update(output, sampled_for(output))
    with pytest.raises(ValueError, match="applied twice"):
        sched.update(output, {"a": 1})


def test_a_sequence_past_max_tokens_refuses_more() -> None:
    s = seq("a", 2, max_tokens=1)
    s.append_token(3)
    with pytest.raises(ValueError, match="max_tokens=1"):
        s.append_token(4)
