"""The real engine behind the daemon's Generator protocol: engine.LLMEngine on MLX.

Built and used on the engine thread only. Importing this module imports MLX
(through ``engine``, which preloads OpenBLAS first on Linux).
"""

from __future__ import annotations

from daemon.worker.generator import JobRejected, JobStart, Load, StepView, TokenOut
from engine import EngineConfig, LLMEngine, SamplingParams
from producers.schema import FinishReason, JobRequest


class MLXGenerator:
    """Adapts LLMEngine: job requests in, TokenOut per generated token."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig) -> MLXGenerator:
        """Load a model directory or hub id with the engine options from Settings."""
        return cls(LLMEngine.from_pretrained(model, config))

    def encode(self, job_id: str, request: JobRequest) -> list[int]:
        try:
            if request.prompt is not None:
                ids = list(self.tokenizer.encode(request.prompt))
            elif request.messages is not None:
                ids = list(
                    self.tokenizer.apply_chat_template(
                        [m.model_dump() for m in request.messages],
                        add_generation_prompt=True,
                        tokenize=True,
                    )
                )
            else:
                ids = list(request.prompt_token_ids or ())
        except Exception as exc:  # a tokenizer/template error is the job's fault, not ours
            raise JobRejected(job_id, f"prompt: cannot tokenize: {exc}") from exc
        if not ids:
            raise JobRejected(job_id, "prompt: empty after tokenizing")
        return [int(t) for t in ids]

    def start(self, job: JobStart) -> FinishReason | None:
        try:
            finished = self.engine.add_request(
                job.job_id,
                prompt_token_ids=job.prompt_token_ids,
                params=SamplingParams(**job.request.sampling()),
                priority=job.request.priority,
                resume_output_token_ids=job.emitted,
            )
        except ValueError as exc:
            raise JobRejected(job.job_id, str(exc)) from exc
        return FinishReason(finished) if finished is not None else None

    def abort(self, job_id: str) -> None:
        self.engine.abort(job_id)

    def step(self) -> list[TokenOut]:
        return [
            TokenOut(
                job_id=out.request_id,
                token_id=out.token_id,
                text=out.text,
                logprob=out.logprob,
                top_logprobs=out.top_logprobs,
                finish_reason=FinishReason(out.finish_reason) if out.finish_reason else None,
            )
            for out in self.engine.step()
        ]

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def load(self) -> Load:
        stats = self.engine.last_step_stats
        total = stats.kv_blocks_total or 1
        return Load(
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_usage=stats.kv_blocks_used / total,
        )

    def last_step(self) -> StepView:
        stats = self.engine.last_step_stats
        return StepView(
            decodes=tuple(c.request_id for c in stats.chunks if c.kind == "decode"),
            prefills=tuple(
                (c.request_id, c.num_tokens) for c in stats.chunks if c.kind != "decode"
            ),
            preempted=tuple(stats.preempted),
            num_batched_tokens=stats.num_scheduled_tokens,
        )
