"""Speculative decoding: proposals checked in the engine's own packed forward.

A decoding row that has a proposal of k tokens is scheduled as a chunk of k + 1
positions (its last token, then the proposal) whose logits are taken at every
position; the engine samples each position as it would have sampled it alone
(same logits processors, same (seed, output position) draw) and keeps the
tokens up to the first one that differs from the proposal, plus the token
sampled there. The K/V written for the rejected positions is rolled back
(Scheduler.update: computed tokens and the block table cut back). So outputs are
the ones speculation-off decoding gives, token for token, greedy and seeded alike.

Proposers: n-gram prompt lookup (``ngram``, batchd.engine.speculative.ngram) and a
draft model (``draft``, batchd.engine.speculative.draft).
"""

from batchd.engine.speculative.draft import DraftProposer, check_draft, load_draft
from batchd.engine.speculative.ngram import NgramIndex, NgramProposer

__all__ = ["DraftProposer", "NgramIndex", "NgramProposer", "check_draft", "load_draft"]
