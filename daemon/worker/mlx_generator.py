"""The real engine behind the daemon's Generator protocol: engine.LLMEngine on MLX.

Built and used on the engine thread only. Importing this module imports MLX
(through ``engine``, which preloads OpenBLAS first on Linux).
"""

from __future__ import annotations

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.daemon.worker.generator import JobRejected, JobStart
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.constraints import Constraint
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.outputs import FinishReason, RequestOutput, StepStats
from batchd.engine.prompt import encode_prompt
from batchd.producers.schema import JobRequest, ResponseFormat, sequence_seed


class MLXGenerator:
    """Adapts LLMEngine: a job is an engine request (its id), its n sequences the
    request's samples."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps_use_cpu = mx.default_device() == mx.cpu
        self.max_model_len: int | None = engine.max_model_len

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig) -> MLXGenerator:
        """Load a model directory or hub id with the engine options from Settings."""
        return cls(LLMEngine.from_pretrained(model, config))

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        messages = None if request.messages is None else [m.model_dump() for m in request.messages]
        tools = (
            None
            if request.tools is None
            else [t.model_dump(exclude_none=True) for t in request.tools]
        )
        try:
            return encode_prompt(
                self.engine.tokenizer,
                job_id,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                messages=messages,
                tools=tools,
            )
        except InvalidRequest as exc:  # the tokenizer refused it, or it is empty; bugs propagate
            raise JobRejected(job_id, f"prompt: {exc}") from exc

    def start(self, job: JobStart) -> FinishReason | None:
        sampling = job.request.sampling()
        if job.request.seed is not None:
            sampling["seed"] = sequence_seed(job.request.seed, job.sample)
        # Sample 0 carries the prompt's logprobs; a resumed one has published them.
        sampling["prompt_logprobs"] &= job.sample == 0 and not job.emitted
        try:
            return self.engine.add_request(
                job.job_id,
                prompt_token_ids=job.prompt_token_ids,
                params=SamplingParams(
                    **sampling, constraint=_constraint(job.request.response_format)
                ),
                priority=job.request.priority,
                resume_output_token_ids=job.emitted,
                sample=job.sample,
                adapter=job.request.adapter,
            )
        except InvalidRequest as exc:  # only the request's fault rejects it; bugs propagate
            raise JobRejected(job.job_id, str(exc)) from exc

    def abort(self, job_id: str) -> None:
        self.engine.abort(job_id)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> StepStats:
        return self.engine.last_step_stats


def _constraint(response_format: ResponseFormat | None) -> Constraint | None:
    """The engine's grammar for a job's response_format (InvalidRequest if it is invalid)."""
    if response_format is None:
        return None
    return Constraint(
        response_format.type, response_format.source(), lenient=response_format.lenient
    )
