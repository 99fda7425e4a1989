"""Plays the model runner for scheduler tests: a deterministic "model" and the step loop."""

from __future__ import annotations

import zlib

from batchd.engine.config import EngineConfig
from batchd.engine.sampling_params import SamplingParams
from batchd.engine.scheduling.schedule import SchedulerOutput
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import FinishReason, Sequence

VOCAB = 16


def token_at(seq_id: str, position: int) -> int:
    """The token a sequence samples at `position`: a pure function, as with a seeded sampler,
    so a recomputed (preempted) sequence must come out with the same outputs."""
    return zlib.crc32(f"{seq_id}:{position}".encode()) % VOCAB


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    *,
    num_blocks: int = 64,
    max_model_len: int = 1024,
    clock: FakeClock | None = None,
    row_tile: int = 1,
    **options: object,
) -> Scheduler:
    """A small scheduler (4 running at most, aging off unless asked) on a fake clock, whose
    runner computes rows in tiles of ``row_tile``."""
    config = EngineConfig(**{"aging_rate": 0.0, "max_num_seqs": 4, **options})  # type: ignore[arg-type]
    return Scheduler(
        config,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        computed_rows=lambda n: -(-n // row_tile) * row_tile,
        clock=clock or FakeClock(),
    )


def seq(
    seq_id: str,
    prompt: list[int] | int,
    *,
    max_tokens: int = 16,
    priority: int = 0,
    at: float = 0.0,
) -> Sequence:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Sequence(
        seq_id, tokens, SamplingParams(max_tokens=max_tokens), priority=priority, arrival_time=at
    )


def sampled_for(output: SchedulerOutput) -> dict[str, int]:
    return {
        c.seq.seq_id: token_at(c.seq.seq_id, c.seq.num_tokens) for c in output.chunks if c.samples
    }


def step(sched: Scheduler) -> list[tuple[str, int, int]]:
    """One engine step; finishes sequences that reached max_tokens. Returns (id, start, n)."""
    output = sched.schedule()
    sched.update(output, sampled_for(output))
    for chunk in output.chunks:
        s = chunk.seq
        if chunk.samples and s.num_output_tokens == s.params.max_tokens:
            sched.finish(s.seq_id, FinishReason.length)
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in output.chunks]


def expected_outputs(s: Sequence) -> list[int]:
    return [token_at(s.seq_id, s.num_prompt_tokens + j) for j in range(s.num_output_tokens)]
