"""A step's sample rows: what the sampler needs to draw each logits row.

The engine builds them on the host while the device computes the forward
(LLMEngine._run), so they read only the requests' output state and their sequences'
tokens, never the logits. A sampling chunk has one row; a speculative verify chunk has
one per proposed token and one more, each at its own output position, so a kept token
is drawn exactly as it would have been without speculation (batchd.engine.speculative).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from batchd.engine.constraints import GrammarTokenizer
from batchd.engine.logits_processors import PenaltyTokens
from batchd.engine.request_state import RequestState
from batchd.engine.sampler import SampleRow
from batchd.engine.scheduling.schedule import ScheduledChunk
from batchd.engine.scheduling.sequence import Sequence as Seq


def sample_rows(
    sampling: Sequence[ScheduledChunk],
    states: Mapping[str, RequestState],
    grammar: GrammarTokenizer,
) -> list[SampleRow]:
    """Every logits row's sampling inputs, in row order (a verify chunk has one per
    proposed token and one more); ``states`` by sequence id."""
    allowed = grammar_masks(sampling, states, grammar)
    rows: list[SampleRow] = []
    for c in sampling:
        state = states[c.seq.seq_id]
        if c.draft:
            rows.extend(verify_rows(state, len(c.draft)))
        else:
            rows.append(sample_row(c.seq, state, allowed.get(c.seq.seq_id)))
    return rows


def grammar_masks(
    sampling: Sequence[ScheduledChunk],
    states: Mapping[str, RequestState],
    grammar: GrammarTokenizer,
) -> dict[str, np.ndarray]:
    """The allowed tokens of every constrained row of this step, by sequence id."""
    ids = [c.seq.seq_id for c in sampling if states[c.seq.seq_id].matcher]
    if not ids:
        return {}
    matchers = [states[i].matcher for i in ids]
    masks = grammar.masks([m for m in matchers if m is not None])
    return dict(zip(ids, masks, strict=True))


def verify_rows(state: RequestState, num_draft: int) -> list[SampleRow]:
    """The sample rows of a verify chunk: the decode's, then one per draft token,
    each at its own output position (its own seeded draw) and min_tokens state."""
    return [
        SampleRow(
            state.params, state.seed, state.num_outputs + j, None, tuple(state.banned_after(j))
        )
        for j in range(num_draft + 1)
    ]


def sample_row(seq: Seq, state: RequestState, allowed: np.ndarray | None) -> SampleRow:
    """A plain row's sampling inputs: its penalised tokens (the request's history, or the
    window of its sequence's last tokens), min_tokens ban and grammar mask."""
    penalised = None
    window = state.params.penalty_window
    if state.history is not None:
        penalised = state.history.tokens()
    elif window is not None and state.params.penalises_recent:
        start = max(0, seq.num_tokens - window)
        penalised = PenaltyTokens.window(seq.tokens(start, seq.num_tokens))
    return SampleRow(
        state.params, state.seed, state.num_outputs, penalised, tuple(state.banned), allowed
    )


def may_speculate(state: RequestState, default: str) -> bool:
    """Whether a decoding row may get proposed tokens: its request asks (or leaves it to
    the engine's ``default`` mode, not "off"), and no logits processor of it depends on
    the tokens before each position beyond that position (a grammar; penalties), so it
    sees exactly the context it would without speculation."""
    params = state.params
    wanted = params.speculative
    if wanted is False or (wanted is None and default == "off"):
        return False
    return state.matcher is None and not params.penalises_recent
