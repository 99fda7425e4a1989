"""Continuous batching: which tokens of which sequences the next forward computes.

Each `schedule()` builds one step under two limits, a token budget
(`max_num_batched_tokens`) and a cap on running sequences (`max_num_seqs`):

1. running decodes (one token each), highest rank first;
2. running sequences still in prefill continue with chunks of what budget is left;
3. waiting sequences are admitted in queue order while budget, the cap and
   blocks allow (strict order: the head that does not fit blocks the rest;
   a sequence that follows a sibling still computing their shared prompt is
   passed over until that sibling has, so the prompt's blocks are shared).

While any sequence decodes, the prefill chunks of steps 2 and 3 share at most
`max_prefill_tokens_with_decodes` tokens when that is set: a step's time
grows with its prefill tokens and every decode waits for the whole step, so
the bound trades time to first token for even inter-token latency. With no
decode running, prefill gets the whole budget. The model runner computes rows
in tiles (`computed_rows`): with `prefill_fills_row_tile` the bound is raised
so the step's rows fill the tile its decodes and bounded prefill reach, since
the tile's rows are computed either way.

Queue order is effective priority, `priority + aging_rate * seconds since
arrival`, highest first, FIFO within a tie. Since every waiting sequence ages
at the same rate, the order never changes while they wait, so it is a sorted
list keyed by `priority - aging_rate * arrival_time`.

When a running sequence needs a block and none is free, the lowest-ranked
running sequence (lowest effective priority, then most recently admitted) is
preempted by recompute: blocks freed, back to the waiting queue ahead of
newer arrivals of its priority, its outputs later recomputed as prompt (the
prefix cache usually makes that cheap). If it is the requester itself, it
yields. Nothing is admitted in a step that preempted. With preemption off,
admission reserves every running sequence's worst case instead, so a running
sequence always finds its next block.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

from batchd.engine.config import EngineConfig
from batchd.engine.exceptions import RequestRejected
from batchd.engine.scheduling.block_manager import BlockManager
from batchd.engine.scheduling.schedule import ScheduledChunk, SchedulerOutput, StepBuilder
from batchd.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["RequestRejected", "ScheduledChunk", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Owns the sequences between add() and finish()/abort(), and the block manager.

    Per step the caller runs: `out = schedule()`, the forward over `out.chunks`,
    `update(out, sampled)`, then `finish()` for each sequence that stopped
    (a sequence must be finished once it has max_tokens outputs).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        computed_rows: Callable[[int], int] | None = None,
        kv_window: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        propose: Callable[[Sequence, int], Seq[int]] | None = None,
    ) -> None:
        self.config = config
        # Speculative decoding: a decoding sequence's proposed next tokens, at most the
        # given count (batchd.engine.speculative); None: no speculation.
        self.propose = propose
        self._draft_budget = 0
        # This step's running sequences in order, and (worked out at the first proposal of
        # the step) the fresh blocks the chunks from each one on need: a proposal never
        # takes blocks a later chunk needs (it would preempt that sequence).
        self._order: list[Sequence] = []
        self._needs_from: list[int] | None = None
        self.max_model_len = max_model_len
        # Rows the model runner computes for a step of n tokens (n when not told).
        self.computed_rows = computed_rows or (lambda n: n)
        # kv_window: every layer's attention window (ModelSpec.kv_window), or None.
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            window=kv_window,
        )
        self._clock = clock
        self._seqs: dict[str, Sequence] = {}
        self._waiting: list[tuple[float, int, Sequence]] = []  # sorted: queue order
        self._running: list[Sequence] = []
        self._admission: dict[str, int] = {}  # seq_id -> admission number (running only)
        self._ticket = itertools.count(1)
        self.num_preemptions = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission, preempted ones included."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, seq_id: str) -> Sequence | None:
        """The live (waiting or running) sequence with this id, else None."""
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def effective_priority(self, seq: Sequence) -> float:
        """priority + aging_rate * seconds since arrival, on the scheduler's clock."""
        return seq.priority + self.config.aging_rate * (self._clock() - seq.arrival_time)

    def stats(self) -> dict[str, float]:
        """Figures for logs and metrics: pool use, prefix-cache hits, preemptions, queue."""
        bm = self.block_manager
        now = self._clock()
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "blocks_total": bm.num_blocks,
            "blocks_used": bm.num_used_blocks,
            "blocks_free": bm.num_free_blocks,
            "blocks_cached": bm.num_cached_blocks,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_hit_tokens": bm.hit_tokens,
            "prefix_cache_query_tokens": bm.query_tokens,
            "num_evictions": bm.num_evictions,
            "num_preemptions": self.num_preemptions,
            "oldest_wait_s": max((now - s.arrival_time for _, _, s in self._waiting), default=0.0),
        }

    # -- requests --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises RequestRejected if it could never run, ValueError
        if its id is already live or it is not new."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id!r} is already waiting or running")
        if seq.status is not SequenceStatus.waiting or seq.block_table or seq.num_output_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is not new: {seq!r}")
        self._check_fits(seq)
        self._seqs[seq.seq_id] = seq
        self._enqueue(seq, ahead=False)

    def finish(self, seq_id: str, reason: FinishReason) -> Sequence:
        """End a live sequence in any state; its blocks go back at once (cached ones stay
        in the prefix cache). Raises KeyError if the id is not live."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not waiting or running")
        if seq.is_running:
            self._stop_running(seq)
        else:
            self._waiting.remove(next(e for e in self._waiting if e[2] is seq))
        seq.status = SequenceStatus.finished
        seq.finish_reason = reason
        return seq

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish with reason abort, from any state; None if the id is not live."""
        return self.finish(seq_id, FinishReason.abort) if seq_id in self._seqs else None

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks (decodes first) and the slots their K/V go to."""
        step = StepBuilder(self.config.max_num_batched_tokens, self.config.block_size)
        ranked = sorted(self._running, key=self._rank, reverse=True)
        decodes = [s for s in ranked if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in ranked if s.num_tokens - s.num_computed_tokens > 1]
        bound = self.config.max_prefill_tokens_with_decodes
        if decodes and bound is not None:
            # every decode waits for this step's prefill work
            step.bound_prefill(self._prefill_bound(len(decodes), bound))
        rows = self.config.speculative_max_decode_rows
        # Proposed tokens this step may still verify (speculative decoding).
        # Never a token a decode of this step needs (the budget holds every decode).
        limit = step.budget if rows is None else min(rows, step.budget)
        self._draft_budget = max(0, limit - len(decodes))
        self._order, self._needs_from = decodes + prefills, None
        for i, seq in enumerate(self._order):
            if not seq.is_running:
                continue  # preempted earlier in this step
            left = seq.num_tokens - seq.num_computed_tokens
            num = min(left, step.budget if left == 1 else step.prefill_budget)
            if num == 0:
                break
            draft = self._draft(seq, step, i) if left == 1 and self.propose is not None else ()
            if self._make_room(seq, seq.num_computed_tokens + num + len(draft), step):
                step.add(seq, num, draft)
        if not step.preempted:
            self._admit(step)
        return step.build()

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | Seq[int]]) -> None:
        """Record a finished forward: advance computed tokens, cache newly full blocks,
        append each sampling chunk's token. `sampled` holds the ids of the chunks with
        `samples` (those of sequences finished or aborted since schedule() may be left
        out; their chunks are ignored). Raises ValueError on any other mismatch.

        A verify chunk's entry is the list of its accepted tokens: the draft tokens that
        were confirmed, then the token sampled after them (1 to len(draft) + 1 tokens).
        Only the positions whose input was confirmed stay computed; the blocks beyond
        them go back to the pool (their K/V was written for rejected tokens)."""
        allowed = {c.seq.seq_id for c in output.chunks if c.samples}
        required = {c.seq.seq_id for c in output.chunks if c.samples and c.seq.is_running}
        if not required <= set(sampled) <= allowed:
            raise ValueError(
                f"sampled ids {sorted(sampled)}: the sampling chunks are {sorted(allowed)}"
            )
        for chunk in output.chunks:
            seq = chunk.seq
            if not seq.is_running:
                continue
            if seq.num_computed_tokens != chunk.start:
                raise ValueError(
                    f"{seq.seq_id}: chunk starts at {chunk.start} but {seq.num_computed_tokens} "
                    "tokens are computed (output applied twice?)"
                )
            if chunk.draft:
                self._accept(chunk, sampled[seq.seq_id])
                continue
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.register_full_blocks(seq, start=chunk.start)
            self.block_manager.release_passed(seq)
            if chunk.samples:
                token = sampled[seq.seq_id]
                assert isinstance(token, int), f"{seq.seq_id}: one token for a decode"
                seq.append_token(token)

    # -- internals -------------------------------------------------------------------------

    def _draft(self, seq: Sequence, step: StepBuilder, index: int) -> tuple[int, ...]:
        """The proposal to verify after ``seq``'s decode (``index`` in this step's order):
        within the step's budget, within the sequence's max_tokens (so its worst-case
        blocks still hold) and cut to the positions its blocks and the free blocks no later
        chunk of this step needs hold (speculation never preempts)."""
        assert self.propose is not None
        room = min(
            step.budget - 1,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self._draft_budget,
        )
        if room < 1:
            return ()
        draft = tuple(self.propose(seq, room))[:room]
        if not draft:
            return ()
        draft = draft[: max(0, self._draft_fits(seq, step, index))]
        self._draft_budget -= len(draft)
        return draft

    def _draft_fits(self, seq: Sequence, step: StepBuilder, index: int) -> int:
        """Proposed tokens ``seq``'s blocks and the spare free blocks hold past its decode."""
        bm = self.block_manager
        if self._needs_from is None:  # once a step, and only in a step that proposes
            needs = [self._chunk_blocks(s, step) for s in self._order]
            self._needs_from = [*itertools.accumulate(reversed(needs))][::-1] + [0]
        spare = bm.num_free_blocks - self._needs_from[index + 1]
        return (len(seq.block_table) + spare) * bm.block_size - seq.num_computed_tokens - 1

    def _chunk_blocks(self, seq: Sequence, step: StepBuilder) -> int:
        """Fresh blocks the chunk ``schedule`` gives a running sequence at most needs
        (its decode, or a prefill chunk within the step's prefill budget)."""
        left = seq.num_tokens - seq.num_computed_tokens
        num = 1 if left == 1 else min(left, step.prefill_budget)
        return self.block_manager.num_new_blocks(seq, seq.num_computed_tokens + num)

    def _accept(self, chunk: ScheduledChunk, tokens: int | Seq[int]) -> None:
        """Apply a verify chunk's accepted tokens; roll back the rest."""
        seq, bm = chunk.seq, self.block_manager
        accepted = [tokens] if isinstance(tokens, int) else list(tokens)
        if not 1 <= len(accepted) <= len(chunk.draft) + 1:
            raise ValueError(
                f"{seq.seq_id}: {len(accepted)} tokens for a draft of {len(chunk.draft)}"
            )
        if list(chunk.draft[: len(accepted) - 1]) != accepted[:-1]:
            raise ValueError(
                f"{seq.seq_id}: accepted tokens {accepted} disagree with the draft {chunk.draft}"
            )
        for token in accepted:
            seq.append_token(token)
        # Inputs confirmed: the decode's token and the accepted draft tokens.
        seq.num_computed_tokens = chunk.start + len(accepted)
        bm.truncate(seq, seq.num_computed_tokens)
        bm.register_full_blocks(seq, start=chunk.start)
        bm.release_passed(seq)

    def _prefill_bound(self, num_decodes: int, bound: int) -> int:
        """Prefill tokens allowed beside ``num_decodes`` decodes: ``bound``, raised (with
        prefill_fills_row_tile) to the rows the runner computes for that step anyway."""
        if not self.config.prefill_fills_row_tile:
            return bound
        return max(bound, self.computed_rows(num_decodes + bound) - num_decodes)

    def _check_fits(self, seq: Sequence) -> None:
        prompt, max_tokens = seq.num_prompt_tokens, seq.params.max_tokens
        total = prompt + max_tokens
        where = f"request {seq.request_id!r}"
        if total > self.max_model_len:
            raise RequestRejected(
                f"{where}: prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        blocks = self._worst_case_blocks(seq)
        if blocks > self.block_manager.num_blocks:
            raise RequestRejected(
                f"{where}: prompt ({prompt} tokens) + max_tokens ({max_tokens}) needs {blocks} "
                f"KV blocks of {self.config.block_size} tokens, the pool has "
                f"{self.block_manager.num_blocks}"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and prompt > budget:
            raise RequestRejected(
                f"{where}: prompt ({prompt} tokens) exceeds max_num_batched_tokens {budget} "
                "and chunked prefill is off"
            )

    def _worst_case_blocks(self, seq: Sequence) -> int:
        # The last sampled token is never fed back, so K/V is needed for one token less.
        return self.block_manager.blocks_for(seq.num_prompt_tokens + seq.params.max_tokens - 1)

    def _static_priority(self, seq: Sequence) -> float:
        # effective_priority(seq) minus the same aging_rate * now for everyone.
        return seq.priority - self.config.aging_rate * seq.arrival_time

    def _rank(self, seq: Sequence) -> tuple[float, int]:
        """Running order, highest first; the lowest is the next preemption victim."""
        return self._static_priority(seq), -self._admission[seq.seq_id]

    def _enqueue(self, seq: Sequence, *, ahead: bool) -> None:
        # Ties on priority: newcomers FIFO; a preempted sequence goes ahead of them.
        ticket = next(self._ticket)
        bisect.insort(
            self._waiting, (-self._static_priority(seq), -ticket if ahead else ticket, seq)
        )

    def _make_room(self, seq: Sequence, num_tokens: int, step: StepBuilder) -> bool:
        """Blocks for positions [0, num_tokens) of a running sequence, preempting the
        lowest-ranked running sequences if needed. False if `seq` itself was preempted."""
        bm = self.block_manager
        while bm.num_new_blocks(seq, num_tokens) > bm.num_free_blocks:
            assert self.config.enable_preemption, "worst-case reservation at admission failed"
            victim = min(self._running, key=self._rank)
            self._preempt(victim, step)
            if victim is seq:
                return False
        bm.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, step: StepBuilder) -> None:
        self._stop_running(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = SequenceStatus.preempted
        self._enqueue(seq, ahead=True)
        step.drop(seq)
        self.num_preemptions += 1

    def _stop_running(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._running.remove(seq)
        del self._admission[seq.seq_id]

    def _admit(self, step: StepBuilder) -> None:
        config, bm = self.config, self.block_manager
        while step.prefill_budget > 0 and len(self._running) < config.max_num_seqs:
            # A sequence waiting for its sibling's prefix is passed over, not a barrier.
            head = next((i for i, e in enumerate(self._waiting) if e[2].may_admit), None)
            if head is None:
                return
            seq = self._waiting[head][2]
            hits = bm.match_prefix(seq)
            cached = len(hits) * bm.block_size
            remaining = seq.num_tokens - cached
            # Unchunked: the prompt goes whole; only a recompute longer than any step is split.
            whole = not config.enable_chunked_prefill and remaining <= config.max_num_batched_tokens
            if whole and remaining > step.prefill_budget:
                return
            num = min(remaining, step.prefill_budget)
            if not self._can_admit(seq, hits, cached + num):
                return
            self._waiting.pop(head)
            bm.admit(seq, hits)
            bm.grow(seq, cached + num)
            seq.status = SequenceStatus.running
            self._running.append(seq)
            self._admission[seq.seq_id] = next(self._ticket)
            step.add(seq, num)

    def _can_admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        bm = self.block_manager
        if self.config.enable_preemption:
            fresh = bm.blocks_for(num_tokens) - len(hits)
            return bm.can_allocate(fresh, reuse=hits)
        # No preemption: keep room for every running sequence to reach its worst case.
        reserved = sum(self._worst_case_blocks(s) - len(s.block_table) for s in self._running)
        return bm.can_allocate(reserved + self._worst_case_blocks(seq) - len(hits), reuse=hits)
