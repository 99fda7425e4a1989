"""Random interleavings of add / step / finish / abort against a small pool.

After every operation: no block leaked or freed twice, ref counts equal the
number of block tables holding each block, budget, prefill bound and running
cap respected, and every position a chunk attends to holds the K/V of exactly
its own prefix (a shadow of what the "runner" wrote to each slot). At the end every request is
driven to completion with its outputs intact. With a sliding window (a model whose every
layer has one), a chunk attends only to the window before it, and exactly the blocks wholly
before that window are released.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st
from scheduler_harness import FakeClock, expected_outputs, sampled_for

from batchd.engine.config import EngineConfig
from batchd.engine.exceptions import RequestRejected
from batchd.engine.sampling_params import SamplingParams
from batchd.engine.scheduling.block_manager import RELEASED
from batchd.engine.scheduling.schedule import SchedulerOutput
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus

STOP_TOKEN = 7
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 0, 0, 0, 0], [5] * 8)
OPS = ("add",) * 6 + ("step",) * 4 + ("step_abort", "end", "dup", "tick")


@st.composite
def configs(draw: st.DrawFn) -> tuple[EngineConfig, int, int, int | None]:
    max_num_seqs = draw(st.integers(1, 4))
    block_size = draw(st.sampled_from([1, 2, 4]))
    chunked = draw(st.booleans())
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 12)),
        max_prefill_tokens_with_decodes=draw(st.none() | st.integers(1, 6)) if chunked else None,
        block_size=block_size,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        enable_preemption=draw(st.booleans()),
        aging_rate=draw(st.sampled_from([0.0, 0.5])),
    )
    # A pool of 12 to 36 tokens: tight enough to preempt and evict, and to reject some requests.
    num_blocks = draw(st.integers(12 // block_size, 36 // block_size))
    return config, num_blocks, draw(st.integers(12, 64)), draw(st.none() | st.integers(1, 8))


class Harness:
    """Drives a Scheduler as the engine would, checking it against shadow records."""

    def __init__(
        self, config: EngineConfig, num_blocks: int, max_model_len: int, window: int | None
    ) -> None:
        self.config = config
        self.clock = FakeClock()
        self.window = window
        self.sched = Scheduler(
            config,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            kv_window=window,
            clock=self.clock,
        )
        self.max_model_len = max_model_len
        self.live: list[str] = []
        self.done: list[Sequence] = []
        self.slot_prefix: dict[int, tuple[int, ...]] = {}  # what each K/V slot was computed from
        self.next_id = 0

    def add(self, prompt: list[int], max_tokens: int, priority: int) -> None:
        seq = Sequence(
            f"s{self.next_id}",
            prompt,
            SamplingParams(max_tokens=max_tokens),
            priority=priority,
            arrival_time=self.clock.now,
        )
        self.next_id += 1
        bs, config = self.config.block_size, self.config
        fits = (
            len(prompt) + max_tokens <= self.max_model_len
            and -(-(len(prompt) + max_tokens - 1) // bs) <= self.sched.block_manager.num_blocks
            and (config.enable_chunked_prefill or len(prompt) <= config.max_num_batched_tokens)
        )
        try:
            self.sched.add(seq)
        except RequestRejected:
            assert not fits
            return
        assert fits
        self.live.append(seq.seq_id)

    def step(self, abort: str | None = None) -> None:
        had_work = self.sched.has_unfinished()
        decoding = any(
            s is not None and s.is_running and s.num_tokens - s.num_computed_tokens == 1
            for s in map(self.sched.get, self.live)
        )
        output = self.sched.schedule()
        assert not had_work or not output.is_empty, "a step with work to do scheduled nothing"
        self.check_output(output)
        bound = self.config.max_prefill_tokens_with_decodes
        assert not decoding or bound is None or output.num_prefill_tokens <= bound
        if abort is not None:
            self.end(abort, FinishReason.abort)
        for chunk in output.chunks:  # the runner writes K/V whatever happened since
            for pos, slot in zip(chunk.positions, chunk.slots, strict=True):
                self.slot_prefix[slot] = tuple(chunk.seq.tokens(0, pos + 1))
        self.sched.update(output, sampled_for(output))
        for chunk in output.chunks:
            seq = chunk.seq
            if not chunk.samples or seq.status is not SequenceStatus.running:
                continue
            if seq.num_output_tokens == seq.params.max_tokens:
                self.end(seq.seq_id, FinishReason.length)
            elif seq.last_token == STOP_TOKEN:
                self.end(seq.seq_id, FinishReason.stop)
        self.clock.now += 1.0

    def end(self, seq_id: str, reason: FinishReason) -> None:
        seq = self.sched.abort(seq_id) if reason is FinishReason.abort else None
        seq = seq or self.sched.finish(seq_id, reason)
        assert seq.status is SequenceStatus.finished and seq.block_table == []
        self.live.remove(seq_id)
        self.done.append(seq)

    def check_output(self, output: SchedulerOutput) -> None:
        config, size = self.config, self.config.block_size
        bm = self.sched.block_manager
        assert output.num_batched_tokens == sum(c.num_tokens for c in output.chunks)
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len({c.seq.seq_id for c in output.chunks}) == len(output.chunks)
        kinds = [c.is_decode for c in output.chunks]
        assert kinds == sorted(kinds, reverse=True), "decodes must come first"
        for chunk in output.chunks:
            seq, table = chunk.seq, chunk.seq.block_table
            assert seq.status is SequenceStatus.running
            assert chunk.start == seq.num_computed_tokens
            assert 0 < chunk.num_tokens and chunk.start + chunk.num_tokens <= seq.num_tokens
            assert chunk.samples == (chunk.start + chunk.num_tokens == seq.num_tokens)
            if not config.enable_chunked_prefill:
                assert chunk.samples or seq.num_output_tokens > 0, "unchunked prompt was split"
            assert chunk.slots == [table[p // size] * size + p % size for p in chunk.positions]
            for pos in chunk.positions:  # written blocks are private and not cached
                block = bm.blocks[table[pos // size]]
                assert block.ref_count == 1 and block.hash is None
            seen = 0 if self.window is None else max(0, chunk.start - self.window + 1)
            for pos in range(seen, chunk.start):  # read K/V belongs to this exact prefix
                assert table[pos // size] != RELEASED, f"{seq}: position {pos} released"
                slot = table[pos // size] * size + pos % size
                assert self.slot_prefix.get(slot) == tuple(seq.tokens(0, pos + 1))
        for seq in output.preempted:
            assert seq.status is SequenceStatus.preempted and seq.block_table == []
            assert seq not in [c.seq for c in output.chunks]

    def check_state(self) -> None:
        sched, bm = self.sched, self.sched.block_manager
        bm.check_invariants()
        seqs = [sched.get(seq_id) for seq_id in self.live]
        assert all(s is not None for s in seqs) and sched.has_unfinished() == bool(seqs)
        running = [s for s in seqs if s is not None and s.status is SequenceStatus.running]
        assert len(running) == sched.num_running <= self.config.max_num_seqs
        assert sched.num_waiting == len(seqs) - len(running)
        holders = Counter(b for s in running for b in s.block_table if b != RELEASED)
        assert holders == Counter({b.block_id: b.ref_count for b in bm.blocks if b.ref_count})
        for s in seqs:
            assert s is not None
            if s.status is SequenceStatus.running:
                assert len(s.block_table) == bm.blocks_for(s.num_computed_tokens)
                window = self.window
                passed = (
                    0 if window is None else (s.num_computed_tokens - window + 1) // bm.block_size
                )
                released = [i for i, b in enumerate(s.block_table) if b == RELEASED]
                assert released == list(range(max(0, passed))), (s, passed)
            else:
                assert s.block_table == [] and s.num_computed_tokens == 0


def prompts() -> st.SearchStrategy[list[int]]:
    shared = st.tuples(st.sampled_from(PREFIXES), st.integers(0, 8)).map(lambda p: p[0][: p[1]])
    tail = st.lists(st.integers(0, 3), min_size=1, max_size=8)
    return st.tuples(shared, tail).map(lambda p: p[0] + p[1])


def apply(harness: Harness, op: str, data: st.DataObject) -> None:
    """One random operation, as an engine driven by a daemon could issue it."""
    if op == "add":
        harness.add(
            data.draw(prompts(), label="prompt"),
            data.draw(st.integers(1, 16), label="max_tokens"),
            data.draw(st.integers(0, 2), label="priority"),
        )
    elif op == "step":
        harness.step()
    elif op == "tick":
        harness.clock.now += data.draw(st.sampled_from([0.5, 5.0]), label="seconds")
    elif not harness.live:
        assert harness.sched.abort("missing") is None
    else:
        seq_id = data.draw(st.sampled_from(harness.live), label="target")
        if op == "step_abort":
            harness.step(abort=seq_id)
        elif op == "dup":
            live = harness.sched.get(seq_id)
            assert live is not None
            try:
                harness.sched.add(Sequence(seq_id, live.prompt_token_ids))
                raise AssertionError("a live id was accepted twice")
            except ValueError as error:
                assert not isinstance(error, RequestRejected)
        else:
            reason = data.draw(st.sampled_from([FinishReason.abort, FinishReason.stop]))
            harness.end(seq_id, reason)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=configs(), data=st.data())
def test_random_interleavings_keep_the_invariants(
    setup: tuple[EngineConfig, int, int, int | None], data: st.DataObject
) -> None:
    harness = Harness(*setup)
    for op in data.draw(st.lists(st.sampled_from(OPS), min_size=20, max_size=60), label="ops"):
        apply(harness, op, data)
        harness.check_state()
    for _ in range(500):  # every request finishes: no starvation, no livelock
        if not harness.sched.has_unfinished():
            break
        harness.step()
        harness.check_state()
    assert not harness.sched.has_unfinished() and not harness.live
    stats = harness.sched.stats()
    target(float(stats["num_preemptions"]), label="preemptions")  # steer towards pressure
    event(f"preemptions: {min(int(stats['num_preemptions']), 3)}")
    event(f"prefix hits: {stats['prefix_cache_hit_tokens'] > 0}")
    event(f"evictions: {stats['num_evictions'] > 0}")
    event(f"requests: {min(len(harness.done), 5)}")
    event(f"window releases: {harness.sched.block_manager.num_window_releases > 0}")
    assert harness.sched.block_manager.num_used_blocks == 0
    for seq in harness.done:  # preempted and recomputed or not, outputs are the model's
        assert seq.output_token_ids == expected_outputs(seq)
        if seq.finish_reason is FinishReason.length:
            assert seq.num_output_tokens == seq.params.max_tokens
