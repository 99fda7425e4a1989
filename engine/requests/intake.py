"""A new request's checks, and the output state and sequence it is admitted as.

LLMEngine.add_request encodes the prompt and takes the adapter; this checks the
request's ids against the model and builds what the engine keeps of it: the
RequestState (outputs, seed, stop conditions, grammar, penalties) and the scheduler's
Sequence.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any, Protocol

from batchd.engine.constraints import GrammarTokenizer
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.logits_processors import PenaltyHistory
from batchd.engine.models.loader import ModelSpec
from batchd.engine.prompt import check_ids
from batchd.engine.request_state import RequestState
from batchd.engine.sampling_params import SamplingParams
from batchd.engine.scheduling.sequence import Sequence as Seq


class Admits(Protocol):
    """What a request is checked against and its state built with, read at each request
    (LLMEngine is one: a caller may change its end tokens between requests)."""

    tokenizer: Any
    spec: ModelSpec
    max_model_len: int
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    grammar_tokenizer: GrammarTokenizer


def request_state(
    model: Admits,
    request_id: str,
    ids: list[int],
    resumed: list[int],
    params: SamplingParams,
    *,
    rng: random.Random,
) -> RequestState:
    """The output state of a request of prompt ``ids`` that already delivered
    ``resumed``, seeded from ``rng`` when its params name no seed. Raises InvalidRequest
    for an id outside the vocabulary (prompt, resumed outputs, logit bias) or a prompt
    that leaves no room in max_model_len."""
    biased = [t for t, _ in params.logit_bias]
    check_ids(request_id, ids + resumed + biased, model.spec.vocab_size)
    if len(ids) >= model.max_model_len:
        raise InvalidRequest(
            f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room in "
            f"max_model_len {model.max_model_len}"
        )
    return RequestState(
        request_id,
        params,
        seed=params.seed if params.seed is not None else rng.getrandbits(63),
        tokenizer=model.tokenizer,
        eos_token_ids=model.eos_token_ids,
        # Generation also stops at the context length (finish_reason "length").
        max_outputs=min(params.max_tokens, model.max_model_len - len(ids)),
        matcher=(model.grammar_tokenizer.matcher(params.constraint) if params.constraint else None),
        history=PenaltyHistory.of_request(params, ids),
        special_ids=model.special_token_ids,
    )


def sequence(
    request_id: str,
    state: RequestState,
    ids: Sequence[int],
    resumed: Sequence[int],
    *,
    sample: int,
    priority: int,
    adapter: str | None,
) -> Seq:
    """The scheduler's sequence of a request's sample: its prompt and resumed outputs,
    with the max_tokens its state has left."""
    remaining = dataclasses.replace(state.params, max_tokens=state.max_outputs - len(resumed))
    # The scheduler's key: unique per (request, sample), never read back.
    return Seq(
        f"{request_id}/{sample}",
        [*ids, *resumed],
        remaining,
        priority=priority,
        request_id=request_id,
        sample=sample,
        adapter=adapter,
    )
