"""Draft-model proposals: a smaller model of the same tokenizer guesses the next tokens.

Each sequence that speculates keeps its own mlx-lm KV cache of the draft model and
the tokens that cache holds. A proposal first trims from the cache what the
sequence did not keep (the rejected tail of its last proposal), feeds it the
sequence's tokens it has not seen (the prompt on first use, then the tokens accepted
since) and generates k tokens greedily, one draft forward each. The engine verifies
them like any proposal, so what the draft proposes changes the speed only, never the
outputs. Cost: k small forwards per speculating row and step, one row at a time,
before the target's step; and the draft's K/V of every speculating sequence, held
until it ends or is preempted (``drop``).
"""

from __future__ import annotations

from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.models.registry import resolve_model
from batchd.engine.scheduling.sequence import Sequence

# Prompt tokens fed to the draft per forward (bounds its activations on long prompts).
_PREFILL_CHUNK = 512


class _DraftCache:
    """One sequence's draft K/V and the tokens it holds, position for position."""

    __slots__ = ("cache", "tokens")

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.tokens: list[int] = []


def check_draft(target: LoadedModel, draft: LoadedModel, *, source: str) -> None:
    """Raise ValueError unless ``draft`` can propose for ``target``: the same tokenizer
    vocabulary (token -> id) and a KV cache that can be trimmed back."""
    mine, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if mine != theirs:
        differ = sum(1 for t, i in theirs.items() if mine.get(t) != i)
        raise ValueError(
            f"speculative_draft_model {source!r}: its tokenizer's vocabulary ({len(theirs)} "
            f"tokens, {differ} of them absent or numbered differently) is not the target "
            f"model's ({len(mine)} tokens); a draft model must share the target's tokenizer"
        )
    if not can_trim_prompt_cache(make_prompt_cache(draft.model)):
        raise ValueError(
            f"speculative_draft_model {source!r}: its KV cache cannot be trimmed back "
            "(sliding-window or recurrent layers), so rejected proposals could not be undone"
        )


def load_draft(source: str, target: LoadedModel, *, k: int, dtype: str | None) -> DraftProposer:
    """Load the draft model ``source`` (directory, hub id or preset name) and check it
    against ``target`` (``check_draft``: ValueError naming what differs)."""
    draft = load(resolve_model(source), dtype=dtype)
    check_draft(target, draft, source=source)
    return DraftProposer(draft, k=k, vocab_size=target.spec.vocab_size)


class DraftProposer:
    """The draft model's per-sequence caches, by sequence id (same interface as
    NgramProposer: ``propose`` then ``drop`` when a sequence ends)."""

    def __init__(self, draft: LoadedModel, *, k: int, vocab_size: int) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be >= 1")
        self.k = k
        self.model = draft.model
        # Proposals stay within the target's vocabulary (a draft may pad its own).
        self.vocab_size = min(vocab_size, draft.spec.vocab_size)
        self._caches: dict[str, _DraftCache] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """``min(k, self.k)`` tokens the draft model greedily continues ``seq`` with."""
        k = min(k, self.k)
        if k < 1:
            return []
        tokens = seq.tokens_view()
        entry = self._caches.get(seq.seq_id)
        if entry is None:
            entry = self._caches[seq.seq_id] = _DraftCache(make_prompt_cache(self.model))
        # Keep the cache's longest prefix the sequence still has, but feed at least the
        # last token (its logits give the first proposal).
        kept = _common_prefix(entry.tokens, tokens, len(tokens) - 1)
        if len(entry.tokens) > kept:
            trim_prompt_cache(entry.cache, len(entry.tokens) - kept)
            del entry.tokens[kept:]
        feed = tokens[kept:]
        proposal: list[int] = []
        while True:
            for start in range(0, len(feed), _PREFILL_CHUNK):
                part = feed[start : start + _PREFILL_CHUNK]
                logits = self.model(mx.array([part]), cache=entry.cache)
            entry.tokens.extend(feed)
            token: int = mx.argmax(logits[0, -1, : self.vocab_size]).tolist()  # type: ignore[assignment]
            proposal.append(token)
            if len(proposal) == k:
                return proposal
            feed = [token]

    def drop(self, seq_id: str) -> None:
        """Forget a sequence that ended or was preempted (its draft K/V is freed)."""
        self._caches.pop(seq_id, None)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
