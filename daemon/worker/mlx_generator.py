"""The real engine behind the daemon's Generator protocol: engine.LLMEngine on MLX.

Built and used on the engine thread only. Importing this module imports MLX
(through ``engine``, which preloads OpenBLAS first on Linux).
"""

from __future__ import annotations

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.daemon.worker.generator import JobRejected, JobStart, Load, StepView, TokenOut
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.constraints import Constraint
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.outputs import ChunkKind
from batchd.engine.prompt import encode_prompt
from batchd.producers.schema import FinishReason, JobRequest, ResponseFormat, sequence_seed


class MLXGenerator:
    """Adapts LLMEngine: job requests in, TokenOut per generated token."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps_use_cpu = mx.default_device() == mx.cpu
        # job id -> the engine request ids of its live sequences
        self._sequences: dict[str, list[str]] = {}

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig) -> MLXGenerator:
        """Load a model directory or hub id with the engine options from Settings."""
        return cls(LLMEngine.from_pretrained(model, config))

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        messages = None if request.messages is None else [m.model_dump() for m in request.messages]
        try:
            return encode_prompt(
                self.engine.tokenizer,
                job_id,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                messages=messages,
            )
        except InvalidRequest as exc:  # the tokenizer refused it, or it is empty; bugs propagate
            raise JobRejected(job_id, f"prompt: {exc}") from exc

    def start(self, job: JobStart) -> FinishReason | None:
        sampling = job.request.sampling()
        if job.request.seed is not None:
            sampling["seed"] = sequence_seed(job.request.seed, job.index)
        # Sequence 0 carries the prompt's logprobs; a resumed one has published them.
        sampling["prompt_logprobs"] &= job.index == 0 and not job.emitted
        siblings = self._sequences.setdefault(job.job_id, [])
        request_id = _request_id(job.job_id, job.index)
        try:
            finished = self.engine.add_request(
                request_id,
                prompt_token_ids=job.prompt_token_ids,
                params=SamplingParams(
                    **sampling, constraint=_constraint(job.request.response_format)
                ),
                priority=job.request.priority,
                resume_output_token_ids=job.emitted,
                # Later sequences take the prompt's blocks from the first one's prefill.
                follows=siblings[0] if siblings else None,
            )
        except InvalidRequest as exc:  # only the request's fault rejects it; bugs propagate
            raise JobRejected(job.job_id, str(exc)) from exc
        if finished is not None:
            return FinishReason(finished.value)
        siblings.append(request_id)
        return None

    def abort(self, job_id: str) -> None:
        for request_id in self._sequences.pop(job_id, [job_id]):
            self.engine.abort(request_id)

    def step(self) -> list[TokenOut]:
        outs = []
        for out in self.engine.step():
            job_id, _, index = out.request_id.partition(_INDEX_MARK)
            if out.finished:
                self._ended(job_id, out.request_id)
            outs.append(
                TokenOut(
                    job_id=job_id,
                    token_id=None if out.error else out.token_id,
                    text=out.text,
                    logprob=out.logprob,
                    top_logprobs=out.top_logprobs,
                    finish_reason=None
                    if out.finish_reason is None
                    else FinishReason(out.finish_reason.value),
                    error=out.error,
                    index=int(index) if index else 0,
                    prompt_logprobs=out.prompt_logprobs,
                )
            )
        return outs

    def _ended(self, job_id: str, request_id: str) -> None:
        siblings = self._sequences.get(job_id, [])
        if request_id in siblings:
            siblings.remove(request_id)
        if not siblings:
            self._sequences.pop(job_id, None)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def load(self) -> Load:
        stats = self.engine.last_step_stats
        total = stats.kv_blocks_total or 1
        return Load(
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_usage=stats.kv_blocks_used / total,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        )

    def last_step(self) -> StepView:
        stats = self.engine.last_step_stats
        return StepView(
            decodes=tuple(
                _job_id(c.request_id) for c in stats.chunks if c.kind is ChunkKind.decode
            ),
            prefills=tuple(
                (_job_id(c.request_id), c.num_tokens)
                for c in stats.chunks
                if c.kind is ChunkKind.prefill
            ),
            preempted=tuple(_job_id(r) for r in stats.preempted),
            num_batched_tokens=stats.num_scheduled_tokens,
        )


# Job ids never hold it (config.NAME_PATTERN), so "<job id>#<index>" names sequence index > 0.
_INDEX_MARK = "#"


def _request_id(job_id: str, index: int) -> str:
    """The engine request id of a job's sequence: the job id for sequence 0 (n=1 as ever)."""
    return job_id if index == 0 else f"{job_id}{_INDEX_MARK}{index}"


def _job_id(request_id: str) -> str:
    return request_id.partition(_INDEX_MARK)[0]


def _constraint(response_format: ResponseFormat | None) -> Constraint | None:
    """The engine's grammar for a job's response_format (InvalidRequest if it is invalid)."""
    if response_format is None:
        return None
    return Constraint(response_format.type, response_format.source())
