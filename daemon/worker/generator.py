"""What the daemon needs from an engine, as a small Protocol.

The worker loop talks to a ``Generator`` only: tokenize a job, start it
(possibly resuming with tokens a previous daemon already published, see
``JobStart``), abort it, step, and report load. :mod:`batchd.daemon.worker.mlx_generator` adapts
``engine.LLMEngine`` to it; tests drive the loop with a deterministic fake.
Every call happens on the engine thread (MLX streams are thread-local).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from batchd.producers.schema import FinishReason, JobRequest


class JobRejected(ValueError):
    """The engine can never run this job (too long for the model, bad sampling values)."""

    def __init__(self, job_id: str, reason: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"job {job_id}: {reason}")


@dataclass(frozen=True)
class JobStart:
    """A job to admit: its request, prompt ids, and outputs it already published.

    ``emitted`` is non-empty when a job resumes after a crash: those tokens count
    as produced and are not emitted again; the text of their events is what was
    delivered, and the next outputs carry on exactly as an uninterrupted run
    (text that was still held back then comes with the next output).
    A job with ``n`` > 1 is started once per sequence, ``index`` 0 first, each with
    its own ``emitted`` tokens; its outputs name the sequence in ``TokenOut.index``,
    and ``abort`` drops all of them.
    """

    job_id: str
    request: JobRequest
    prompt_token_ids: list[int]
    emitted: Sequence[int] = ()
    index: int = 0


@dataclass(frozen=True)
class TokenOut:
    """One output of a step: a new token of a job, and/or its end."""

    job_id: str
    token_id: int | None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: FinishReason | None = None
    # Why the engine ended the job, when it ended it with FinishReason.error.
    error: str | None = None
    # The sequence of a job with n > 1 (JobStart.index); finish_reason ends that one only.
    index: int = 0
    # On the first output of a job that asked: each prompt token's logprob after the first.
    prompt_logprobs: list[float] | None = None


@dataclass(frozen=True)
class StepView:
    """The packed batch of one step, for ``batchd demo --show-steps`` and the heartbeat.

    ``prefills`` maps job id -> tokens of its prompt computed this step.
    """

    decodes: tuple[str, ...] = ()
    prefills: tuple[tuple[str, int], ...] = ()
    preempted: tuple[str, ...] = ()
    num_batched_tokens: int = 0


@dataclass(frozen=True)
class Load:
    """How busy the engine is (for backpressure, the heartbeat and the metrics)."""

    running: int
    waiting: int
    kv_usage: float
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # Prefix-cache tokens reused / tokens looked up at admissions, since start.
    prefix_cache_hit_rate: float = 0.0


class Generator(Protocol):
    """The engine as the daemon sees it."""

    # True when a step keeps the machine's CPU cores busy (the engine computes on the
    # CPU): the daemon then waits for each publish round trip between steps rather than
    # running it beside the next step (batchd.daemon.worker.loop).
    steps_use_cpu: bool = False

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        """Prompt token ids of a job (chat template applied); raises JobRejected."""
        ...

    def start(self, job: JobStart) -> FinishReason | None:
        """Admit a job (one sequence of it). Returns the finish reason instead when its
        ``emitted`` outputs already end it (a crash just before its final event). Raises
        JobRejected."""
        ...

    def abort(self, job_id: str) -> None:
        """Drop a job and free its blocks; no output follows."""
        ...

    def step(self) -> list[TokenOut]:
        """Run one engine step; the outputs of every job that advanced."""
        ...

    def has_work(self) -> bool: ...

    def load(self) -> Load: ...

    def last_step(self) -> StepView | None:
        """The batch the last step packed, if the engine reports it."""
        ...
