"""The engine's proposer, chosen once from its config (docs/engine.md, "Speculative
decoding").

The n-gram proposer is built (and its options checked) whatever the mode, since a request
may ask for speculation while the engine's default is off; ``speculative = "draft"`` with a
draft model replaces it.
"""

from __future__ import annotations

from batchd.engine.config import EngineConfig
from batchd.engine.models.loader import LoadedModel
from batchd.engine.speculative.draft import DraftProposer, load_draft
from batchd.engine.speculative.ngram import NgramProposer


def choose_proposer(
    config: EngineConfig, target: LoadedModel
) -> tuple[NgramProposer | DraftProposer, str]:
    """The proposer for ``target``, and what it proposes from (for the start log). Bad
    n-gram options (checked whichever proposer runs) or a draft model that does not fit
    ``target`` raise ValueError naming what is wrong."""
    ngram = NgramProposer(
        k=config.num_speculative_tokens,
        min_n=config.speculative_ngram_min,
        max_n=config.speculative_ngram_max,
    )
    if config.speculative == "draft" and config.speculative_draft_model is not None:
        draft = load_draft(
            config.speculative_draft_model,
            target,
            k=config.num_speculative_tokens,
            dtype=config.dtype,
        )
        return draft, f"draft model {config.speculative_draft_model}"
    return ngram, f"n-grams {config.speculative_ngram_min}..{config.speculative_ngram_max}"
