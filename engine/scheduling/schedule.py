"""What one engine step computes: the scheduler's output, read by the model runner.

A step is a list of chunks, each a run of consecutive positions of one
sequence with the pool slot every token's K/V is written to. Decodes (one
token that samples) come first so the runner can batch them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from batchd.engine.scheduling.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions [start, start + num_tokens) of `seq`, computed in this step.

    `slots[k]` is where the K/V of position start + k goes; attention reads the
    earlier positions through `seq.block_table`. When `samples` is true the
    chunk reaches the sequence's last token and its logits pick the next token.
    A verify chunk (speculative decoding) is a decode followed by `draft`, tokens
    proposed to come next and not yet in the sequence: logits are taken at each
    of its `num_logits` positions (batchd.engine.speculative).
    """

    seq: Sequence
    start: int
    num_tokens: int
    slots: list[int]
    samples: bool
    draft: tuple[int, ...] = ()

    @cached_property
    def token_ids(self) -> list[int]:
        """The input tokens of this chunk."""
        if self.draft:
            return self.seq.tokens(self.start, self.start + 1) + list(self.draft)
        return self.seq.tokens(self.start, self.start + self.num_tokens)

    @property
    def num_logits(self) -> int:
        """Positions whose logits the step needs: 1 + the draft's length when sampling."""
        return 1 + len(self.draft) if self.samples else 0

    @property
    def is_verify(self) -> bool:
        """A decode with a draft: its positions are verified together."""
        return bool(self.draft)

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the chunk's rows run with (None: the base model)."""
        return self.seq.adapter

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)

    @property
    def is_decode(self) -> bool:
        """One token that samples: attends to the cache, produces the next token. A
        verify chunk counts as a decode for the step's budgets (never as prefill)."""
        return (self.num_tokens == 1 or bool(self.draft)) and self.samples


@dataclass
class SchedulerOutput:
    """One step: chunks (decodes first), who was preempted, how many tokens in all."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decode and verify chunks (a verify chunk's draft included)."""
        return sum(c.num_tokens for c in self.chunks if c.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        """Proposed tokens verified in this step."""
        return sum(len(c.draft) for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class StepBuilder:
    """Collects a step's chunks against the token budget, and optionally a tighter bound on
    the prefill tokens among them; a preempted sequence's chunk is taken back."""

    def __init__(self, budget: int, block_size: int) -> None:
        self.budget = budget
        self.block_size = block_size
        self.preempted: list[Sequence] = []
        self._chunks: dict[str, ScheduledChunk] = {}
        self._prefill_bound: int | None = None
        self._prefill_tokens = 0

    def bound_prefill(self, max_tokens: int) -> None:
        """Let the prefill chunks of this step take `max_tokens` tokens at most, together."""
        self._prefill_bound = max_tokens

    @property
    def prefill_budget(self) -> int:
        """Tokens a prefill chunk may still take: what is left of the budget, within the
        prefill bound if one is set."""
        if self._prefill_bound is None:
            return self.budget
        return max(0, min(self.budget, self._prefill_bound - self._prefill_tokens))

    def add(self, seq: Sequence, num_tokens: int, draft: tuple[int, ...] = ()) -> None:
        """Schedule positions [num_computed, num_computed + num_tokens) of `seq`, whose
        block table already covers them; with a `draft` (a decode only), its positions
        too."""
        start, size, table = seq.num_computed_tokens, self.block_size, seq.block_table
        assert not draft or start + num_tokens == seq.num_tokens, "a draft follows a decode"
        samples = start + num_tokens == seq.num_tokens
        num_tokens += len(draft)
        assert 0 < num_tokens <= self.budget, f"{seq.seq_id}: {num_tokens} tokens over budget"
        end = start + num_tokens
        assert end <= len(table) * size, f"{seq.seq_id}: blocks do not cover position {end - 1}"
        slots = [table[p // size] * size + p % size for p in range(start, end)]
        chunk = ScheduledChunk(seq, start, num_tokens, slots, samples, draft)
        if not chunk.is_decode:
            assert num_tokens <= self.prefill_budget, f"{seq.seq_id}: prefill over its bound"
            self._prefill_tokens += num_tokens
        self._chunks[seq.seq_id] = chunk
        self.budget -= num_tokens

    def drop(self, seq: Sequence) -> None:
        """Record `seq` as preempted, taking back its chunk if it had one."""
        chunk = self._chunks.pop(seq.seq_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens
            if not chunk.is_decode:
                self._prefill_tokens -= chunk.num_tokens
        self.preempted.append(seq)

    def build(self) -> SchedulerOutput:
        chunks = sorted(self._chunks.values(), key=lambda c: not c.is_decode)  # stable
        total = sum(c.num_tokens for c in chunks)
        return SchedulerOutput(chunks=chunks, preempted=self.preempted, num_batched_tokens=total)
