"""What requests get back from a step: one RequestOutput a kept token, and the logprobs
of their prompts as the steps that compute the prompts score them.

The engine keeps the live tables (which samples run, their RequestStates, the prompt
logprobs owed); these functions read and fill them, and the engine retires a sample
whose output finishes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.detokenizer import TokenTexts
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.outputs import RequestOutput
from batchd.engine.request_state import RequestState, TokenVerdict
from batchd.engine.sampler import Samples
from batchd.engine.scheduling.schedule import ScheduledChunk, SchedulerOutput
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import FinishReason
from batchd.engine.scheduling.sequence import Sequence as Seq
from batchd.engine.speculative.verify import accept

# A sampled token's output (LLMEngine._output): seq, token id, logprob, top logprobs.
Output = Callable[[Seq, int, float, list[tuple[int, float]] | None], RequestOutput]


def emit(
    scheduler: Scheduler,
    scheduled: SchedulerOutput,
    sampling: list[ScheduledChunk],
    samples: Samples,
    output: Output,
) -> tuple[list[RequestOutput], int, int]:
    """Keep each verify chunk's accepted run, update the scheduler and emit each kept
    token through ``output``; the outputs, proposed and accepted draft tokens."""
    ids = samples.token_ids
    kept = accept(sampling, ids)
    scheduler.update(scheduled, kept.sampled)
    outputs: list[RequestOutput] = []
    for chunk, first, n in kept.runs:
        for r in range(first, first + n):
            out = output(chunk.seq, ids[r], samples.logprobs[r], samples.top_logprobs[r])
            outputs.append(out)
            if out.finished:
                break  # a stop or max_tokens inside the accepted run: none after
    return outputs, kept.drafted, kept.accepted


def token_output(
    seq: Seq,
    state: RequestState,
    token_id: int,
    logprob: float,
    top: list[tuple[int, float]] | None,
    *,
    prompt_logprobs: list[float] | None,
    token_texts: TokenTexts,
) -> RequestOutput:
    """The output of ``seq``'s next token, ``state`` moved past it. ``prompt_logprobs``:
    the prompt's, delivered with this output (None: not asked, or delivered already). A
    grammar that fails on the token (an llguidance limit) ends this request alone, with
    finish reason error and the reason in ``error``."""
    index = state.num_outputs
    texts = raw = None
    if state.params.token_texts:
        sampled = [token_id, *(t for t, _ in top or ())]
        named = list(sampled)
        if prompt_logprobs is not None:
            named += seq.tokens(0, seq.num_prompt_tokens)
        texts = token_texts.of(named)
        raw = token_texts.bytes_of(sampled) or None
    error = None
    try:
        verdict = state.on_token(token_id)
    except InvalidRequest as exc:
        error = f"request {seq.request_id!r}: {exc}"
        verdict = TokenVerdict("", FinishReason.error)
    return RequestOutput(
        request_id=seq.request_id,
        token_id=token_id,
        text=verdict.text,
        logprob=logprob,
        index=index,
        finished=verdict.finish_reason is not None,
        finish_reason=verdict.finish_reason,
        top_logprobs=top,
        error=error,
        prompt_logprobs=prompt_logprobs,
        sample=seq.sample,
        cached_tokens=seq.num_cached_tokens,
        token_texts=texts,
        token_bytes=raw,
        stop_token=verdict.stop_token,
    )


def prompt_targets(
    chunks: Sequence[ScheduledChunk], owed: Mapping[str, list[float]]
) -> dict[int, list[int]]:
    """For each chunk of a request still owed its prompt's logprobs (``owed``, by sequence
    id), the prompt tokens its positions predict (the one after each), by chunk index."""
    targets = {}
    for i, chunk in enumerate(chunks):
        seq = chunk.seq
        if seq.seq_id in owed:
            count = min(chunk.num_tokens, seq.num_prompt_tokens - 1 - chunk.start)
            if count > 0:
                targets[i] = seq.tokens(chunk.start + 1, chunk.start + 1 + count)
    return targets


def keep_prompt_logprobs(
    chunks: Sequence[ScheduledChunk],
    scores: Mapping[int, mx.array],
    targets: Mapping[int, list[int]],
    owed: MutableMapping[str, list[float]],
) -> None:
    """The step's prompt logprobs (``scores`` by chunk index, evaluated already) into
    their requests' lists in ``owed``, at the positions ``targets`` scored."""
    for i, score in scores.items():
        chunk = chunks[i]
        values = owed[chunk.seq.seq_id]
        values[chunk.start : chunk.start + len(targets[i])] = np.asarray(score).tolist()
