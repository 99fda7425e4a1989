"""What the daemon needs from an engine, as a small Protocol, in the engine's own words.

The worker talks to a ``Generator`` only: tokenize a job, start each of its
sequences (possibly resuming with tokens a previous daemon already published,
see ``JobStart``), abort it, step, and report the last step's figures.
:mod:`batchd.daemon.worker.mlx_generator` adapts ``engine.LLMEngine`` to it;
tests drive the loop with deterministic fakes. Every call happens on the engine
thread (MLX streams are thread-local).

A step's outputs and figures are the engine's own types (``RequestOutput``,
``StepStats``: plain data, no MLX), so no fact is copied into a daemon type on
its way through. The one translation left is a name: the engine's finish reasons
become the wire protocol's by ``FINISH_REASONS``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from batchd.engine.outputs import FinishReason as EngineFinish
from batchd.engine.outputs import RequestOutput, StepStats
from batchd.producers.schema import FinishReason, JobRequest

# Every engine finish reason as the wire protocol names it. The engine's ``abort`` is
# what an aborted sequence ends with; the daemon aborts only to cancel or hand back, so
# on the wire it is ``cancelled``. (``expired`` is the daemon's own: it never starts
# such a job.)
FINISH_REASONS: Mapping[EngineFinish, FinishReason] = MappingProxyType(
    {
        EngineFinish.stop: FinishReason.stop,
        EngineFinish.length: FinishReason.length,
        EngineFinish.abort: FinishReason.cancelled,
        EngineFinish.error: FinishReason.error,
    }
)


class JobRejected(ValueError):
    """The engine can never run this job (too long for the model, bad sampling values)."""

    def __init__(self, job_id: str, reason: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"job {job_id}: {reason}")


@dataclass(frozen=True)
class JobStart:
    """One sequence of a job to admit: its request, prompt ids, and the outputs it
    already published.

    ``emitted`` is non-empty when a job resumes after a crash: those tokens count
    as produced and are not emitted again; the text of their events is what was
    delivered, and the next outputs carry on exactly as an uninterrupted run
    (text that was still held back then comes with the next output).
    A job with ``n`` > 1 is one engine request of n samples: each is started with
    its ``sample`` index, 0 first, and its own ``emitted`` tokens; outputs name it
    in ``RequestOutput.sample``, and ``abort`` drops all of them.
    """

    job_id: str
    request: JobRequest
    prompt_token_ids: list[int]
    emitted: Sequence[int] = ()
    sample: int = 0


class Generator(Protocol):
    """The engine as the daemon sees it."""

    # True when a step keeps the machine's CPU cores busy (the engine computes on the
    # CPU): the daemon then waits for each publish round trip between steps rather than
    # running it beside the next step (batchd.daemon.worker.cadence).
    steps_use_cpu: bool = False
    # The model's context bound (prompt plus outputs of one sequence), announced in the
    # heartbeat for gateways to refuse what cannot fit; None where the engine has none.
    max_model_len: int | None = None

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        """Prompt token ids of a job (chat template applied); raises JobRejected."""
        ...

    def start(self, job: JobStart) -> EngineFinish | None:
        """Admit one sequence of a job (the request ``job_id``, sample ``job.sample``).
        Returns the finish reason instead when its ``emitted`` outputs already end it (a
        crash just before its final event). Raises JobRejected."""
        ...

    def abort(self, job_id: str) -> None:
        """Drop every sequence of a job and free their blocks; no output follows."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one engine step; an output per sequence that advanced (request id = job id;
        ``error`` set: the sequence failed and ``token_id`` is no output)."""
        ...

    def has_work(self) -> bool: ...

    def stats(self) -> StepStats:
        """The last step's figures (its packed batch, and the engine's load after it)."""
        ...
