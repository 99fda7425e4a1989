"""Per-request grammar state and the batched token masks built from it.

llguidance walks the grammar and the tokenizer's byte trie together and
writes one bit per vocabulary entry (measured: docs/performance.md,
Structured output). Masks of all constrained rows of a step are built in
one call on llguidance's own threads, while MLX still computes the forward;
unconstrained rows have no matcher and cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from batchd.engine.constraints.grammar import Constraint
from batchd.engine.exceptions import InvalidRequest


class GrammarTokenizer:
    """llguidance's view of the model's tokenizer, built on first use (~0.2 s at 49k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._built: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def matcher(self, constraint: Constraint) -> RowMatcher:
        if self._built is None:
            self._built = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self._vocab_size, eos_token=self._eos
            )
        return RowMatcher(llguidance.LLMatcher(self._built, constraint.grammar, log_level=0))

    def masks(self, matchers: Sequence[RowMatcher]) -> np.ndarray:
        """The allowed tokens of each matcher, ``bool [len(matchers), vocab]``."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bits = llguidance.numpy.allocate_token_bitmask(len(matchers), self._vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m.llg, i) for i, m in enumerate(matchers)], bits
        )
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return unpacked[:, : self._vocab_size].astype(bool)


class RowMatcher:
    """Where one request stands in its grammar: advanced by every token it emits."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_error():
            raise InvalidRequest(f"grammar refused by llguidance: {matcher.get_error()}")
        self.llg = matcher

    def consume(self, token_id: int) -> None:
        """Advance past ``token_id``; InvalidRequest if the grammar does not allow it."""
        if not self.llg.consume_token(token_id):
            raise InvalidRequest(f"token {token_id} is not allowed here: {self.llg.get_error()}")

    @property
    def stopped(self) -> bool:
        """True when the grammar is complete and allows nothing more (EOS included)."""
        return self.llg.is_stopped()
