"""batchd's engine as a step system (see batchd.daemon.bench.drive)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from batchd.daemon.bench.workloads import Request
from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.outputs import StepStats


def bench_engine_config(
    engine: EngineConfig, *, longest_request: int, max_prefill_tokens_with_decodes: int | None
) -> EngineConfig:
    """batchd's engine options for one run: ``engine`` as given, field by field, with the
    run's prefill bound (the throughput setting, or the online workloads' latency one)
    and, where ``engine.num_kv_blocks`` is unset, a KV pool that holds every running
    sequence whole.

    That pool is sized from the workload, not from free memory, so that the run does
    the same work on any machine (no preemption), and BatchGenerator (whose caches grow
    as needed) is not handicapped by comparison.
    """
    blocks = engine.num_kv_blocks
    if blocks is None:
        blocks_per_seq = -(-longest_request // engine.block_size) + 1
        blocks = engine.max_num_seqs * blocks_per_seq + 64
    return dataclasses.replace(
        engine,
        max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
        num_kv_blocks=blocks,
    )


class BatchdSystem:
    """One LLMEngine, fed greedy requests that ignore EOS and run to max_tokens."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        self.engine = LLMEngine.from_pretrained(str(model_path), config)
        self.steps: list[StepStats] = []  # every step's figures, for the online step profile

    def add(self, request: Request) -> None:
        self.engine.add_request(
            request.request_id,
            prompt_token_ids=request.prompt_ids,
            params=SamplingParams(max_tokens=request.max_tokens, ignore_eos=True),
        )

    def step(self) -> list[tuple[str, int, bool]]:
        outputs = self.engine.step()
        self.steps.append(self.engine.last_step_stats)
        return [(out.request_id, 1, out.finished) for out in outputs]

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished())

    def close(self) -> None:
        """Nothing to release: the engine owns no threads or files."""
