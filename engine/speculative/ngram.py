"""N-gram prompt lookup (vLLM's ``ngram`` method, "prompt lookup decoding").

For a decoding sequence, the last n tokens (n from ``max_n`` down to ``min_n``) are
looked up among the earlier n-grams of its prompt and output; the tokens that
followed the latest earlier occurrence are the proposal (at most k of them). The
index maps each n-gram to the position after its latest occurrence and is
updated incrementally as tokens arrive (a few dict writes per new token), so a
proposal costs a few dict reads whatever the sequence's length.
"""

from __future__ import annotations

from batchd.engine.scheduling.sequence import Sequence


class NgramIndex:
    """One sequence's n-grams of sizes ``min_n..max_n``: each maps to the position just
    after its latest occurrence that has a following token."""

    __slots__ = ("_indexed", "_maps", "_max_n", "_min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self._min_n = min_n
        self._max_n = max_n
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        # n-grams ending before this position are indexed (an n-gram is indexed once the
        # token after it exists).
        self._indexed = 0

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        end = len(tokens)
        maps = self._maps
        for e in range(max(self._indexed, 1), end):
            for n in range(self._min_n, min(self._max_n, e) + 1):
                maps[n][tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of the longest suffix
        n-gram of ``tokens`` found (``update`` first)."""
        end = len(tokens)
        for n in range(min(self._max_n, end), self._min_n - 1, -1):
            at = self._maps[n].get(tuple(tokens[end - n :]))
            if at is not None:
                return tokens[at : min(at + k, end)]
        return []


class NgramProposer:
    """The n-gram indexes of the live sequences, by sequence id."""

    def __init__(self, *, k: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes {min_n}..{max_n}: need 1 <= min <= max")
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be >= 1")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most ``min(k, self.k)`` proposed tokens to follow ``seq``'s tokens."""
        k = min(k, self.k)
        if k < 1:
            return []
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = NgramIndex(self.min_n, self.max_n)
        tokens = seq.tokens_view()
        index.update(tokens)
        return index.propose(tokens, k)

    def drop(self, seq_id: str) -> None:
        """Forget a sequence that ended."""
        self._indexes.pop(seq_id, None)
