"""What the engine hands back: one RequestOutput per new token, StepStats per step.

These are the engine's whole output vocabulary, and plain data (no MLX): a caller such
as the daemon takes them as they are rather than copying them into types of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from batchd.engine.scheduling.sequence import FinishReason

__all__ = ["ChunkKind", "ChunkStat", "FinishReason", "RequestOutput", "StepStats"]


@dataclass(frozen=True)
class RequestOutput:
    """One generated token of one request.

    ``text`` is the text that became final with this token (streaming: never
    half a character, never any part of a stop string; may be empty).
    ``index`` is the token's position among the request's outputs, counting
    tokens a resumed request was given as already produced. ``logprob`` is the
    token's log-probability under the model (after the logits processors:
    logit_bias, penalties, grammar mask; before temperature); ``top_logprobs``
    lists (token_id, logprob) best first when the request asked for
    ``logprobs > 0``. ``finish_reason`` is set on the
    request's last token (stop or length) and None while it runs; ``error``
    says why when it is ``error`` (the request's grammar refused or failed:
    then ``token_id`` is the refused token, not an output).
    ``prompt_logprobs``, on the first output of a request that asked for them, holds
    for each prompt token after the first its log-probability given the tokens
    before it (raw model logits, float32 log-softmax). ``sample`` is the request's
    sample the token belongs to (0 unless it was added with several, see
    ``LLMEngine.add_request``); ``finish_reason`` ends that sample only.
    ``cached_tokens`` is how many of the sequence's tokens took their K/V from the
    prefix cache when it was (last) admitted: full blocks shared with an earlier
    request, never the last prompt token; before any preemption, prompt tokens only.
    ``token_texts`` (requests with ``token_texts``) maps each token id this output names
    (the token, its top_logprobs, the prompt's tokens with ``prompt_logprobs``) to its
    text decoded alone; ``token_bytes`` the bytes of those of them that are only part of a
    multi-byte character (their text shows U+FFFD), as ``TokenTexts.bytes_of`` tells.
    ``stop_token``: the token is a stop token (eos, ``stop_token_ids``, a grammar's end):
    it ends the sample and none of its own text is in ``text`` (only text it released).
    """

    request_id: str
    token_id: int
    text: str
    logprob: float
    index: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    prompt_logprobs: list[float] | None = None
    sample: int = 0
    token_texts: dict[int, str] | None = None
    cached_tokens: int = 0
    token_bytes: dict[int, bytes] | None = None
    stop_token: bool = False


class ChunkKind(str, Enum):
    decode = "decode"
    prefill = "prefill"


@dataclass(frozen=True)
class ChunkStat:
    """One entry of a step's packed batch: a decode, or a prefill chunk of n tokens, of
    sample ``sample`` of a request."""

    request_id: str
    kind: ChunkKind
    start: int
    num_tokens: int
    sample: int = 0


@dataclass(frozen=True)
class StepStats:
    """Figures of one engine step, for logs, metrics and the --show-steps display."""

    step: int
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_outputs: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions_total: int = 0
    preempted: list[str] = field(default_factory=list)
    chunks: list[ChunkStat] = field(default_factory=list)
    # Speculative decoding: tokens proposed and verified this step, and how many of them
    # were accepted; the totals since the engine started.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    # Host time spent building the step's sample rows while the device computed its
    # forward (hidden under device time), and time then spent waiting for the device.
    host_overlap_s: float = 0.0
    sync_wait_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens since the engine started (0 before any)."""
        return self.num_accepted_tokens_total / (self.num_draft_tokens_total or 1)

    @property
    def kv_usage(self) -> float:
        """The share of the KV pool's blocks in use, 0..1."""
        return self.kv_blocks_used / (self.kv_blocks_total or 1)
