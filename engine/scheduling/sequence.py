"""One request as the scheduler sees it: its tokens, its blocks, its progress.

Tokens are kept in one list (prompt then outputs) because after a preemption
the outputs are recomputed as if they were prompt: the scheduler only looks at
`num_tokens` and `num_computed_tokens`, never at which part is which.
"""

from __future__ import annotations

import time
from enum import Enum

from batchd.engine.sampling_params import SamplingParams


class SequenceStatus(str, Enum):
    """Where a sequence is in its life. preempted: back in the waiting queue, KV dropped."""

    waiting = "waiting"
    running = "running"
    preempted = "preempted"
    finished = "finished"


class FinishReason(str, Enum):
    """Why a sequence ended: a stop token/string, max_tokens (or context) reached, aborted,
    or an error of that request alone (its grammar failed)."""

    stop = "stop"
    length = "length"
    abort = "abort"
    error = "error"


class Sequence:
    """A request's tokens and KV bookkeeping.

    `num_computed_tokens` counts the leading tokens whose K/V are in the cache
    (the next step computes from there); `num_cached_tokens` is how many of
    those came from a prefix-cache hit at the last admission. `block_table[i]`
    is the pool block holding positions [i * block_size, (i + 1) * block_size).
    `block_hashes` caches the prefix-cache hash chain of the full blocks of
    `token_ids` (tokens only grow, so it stays valid, preemption included).
    `arrival_time` is on the scheduler's clock (time.monotonic by default).
    `request_id` and `sample` name what the sequence computes: sample `sample` of
    request `request_id` (a request has one sequence per sample; `seq_id`, unique
    among live sequences, is the scheduler's key only). `follows` is a sibling
    (another sample of the same request) this one waits for: it is admitted only
    once that sibling has computed the full blocks of their common prefix, so
    those blocks come from the prefix cache. `adapter` names the LoRA adapter the
    sequence runs with (None: the base model); its K/V differ from the base model's, so
    the prefix cache keys its blocks by it.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        request_id: str | None = None,
        sample: int = 0,
        adapter: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id!r}: prompt_token_ids is empty")
        self.seq_id = seq_id
        self.request_id = seq_id if request_id is None else request_id
        self.sample = sample
        self.adapter = adapter
        self.params = params if params is not None else SamplingParams()
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.waiting
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self._tokens = [int(t) for t in prompt_token_ids]
        self._num_prompt = len(self._tokens)
        self.follows: Sequence | None = None
        self.shared_tokens = 0

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def token_ids(self) -> list[int]:
        """Prompt then outputs (a copy)."""
        return list(self._tokens)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._tokens[: self._num_prompt]

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self._num_prompt :]

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self._tokens) - self._num_prompt

    @property
    def last_token(self) -> int:
        return self._tokens[-1]

    @property
    def is_running(self) -> bool:
        return self.status is SequenceStatus.running

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.finished

    def follow(self, leader: Sequence, *, block_size: int) -> None:
        """Wait for `leader` to compute the full blocks of the tokens both begin with."""
        common = 0
        for mine, theirs in zip(self._tokens, leader._tokens, strict=False):
            if mine != theirs:
                break
            common += 1
        self.shared_tokens = common // block_size * block_size
        self.follows = leader if self.shared_tokens else None

    @property
    def may_admit(self) -> bool:
        """False while the sequence it follows is live and has not computed the shared
        blocks yet."""
        leader = self.follows
        if leader is None or leader.is_finished:
            return True
        return leader.is_running and leader.num_computed_tokens >= self.shared_tokens

    def tokens(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] without copying the whole sequence."""
        return self._tokens[start:stop]

    def tokens_view(self) -> list[int]:
        """Prompt then outputs, the sequence's own list: read it, never change it."""
        return self._tokens

    def set_token(self, position: int, token_id: int) -> None:
        """Put the real id where a stand-in stood: async scheduling appends one for a
        sampled id the host has not read yet (batchd.engine.async_step)."""
        self._tokens[position] = int(token_id)

    def append_token(self, token_id: int) -> None:
        """Add a sampled token. Raises if max_tokens outputs are already there."""
        if self.num_output_tokens >= self.params.max_tokens:
            raise ValueError(
                f"sequence {self.seq_id!r} already has max_tokens={self.params.max_tokens} "
                "outputs; it should have been finished"
            )
        self._tokens.append(int(token_id))
