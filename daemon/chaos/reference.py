"""The fault-free reference: the same seeded requests through the engine in-process."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from batchd.daemon.chaos.workload import ChaosJob
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.producers.schema import job_seed, validate_job


def reference_outputs(
    model: Path, config: EngineConfig, jobs: Sequence[ChaosJob]
) -> tuple[dict[str, list[int]], float]:
    """Every job's token ids from one uninterrupted in-process run, and its seconds.

    Greedy and seeded sampling (every job is seeded) give each job the same tokens in any batch mix
    (the engine's parity tests hold it to mlx-lm), so these are what every job of
    the chaos run must deliver, however often it was interrupted and resumed.
    """
    llm = LLMEngine.from_pretrained(model, config)
    # A job without a seed samples with job_seed(id), as the daemon gives it.
    requests = [validate_job({"seed": job_seed(job.id), **job.payload}) for job in jobs]
    started = time.monotonic()
    outputs = llm.generate(
        [request.prompt_token_ids or [] for request in requests],
        [SamplingParams(**request.sampling()) for request in requests],
    )
    elapsed = time.monotonic() - started
    return {job.id: out for job, out in zip(jobs, outputs, strict=True)}, elapsed
