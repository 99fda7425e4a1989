"""A step's figures (StepStats): what it scheduled, the pool and queues after it, timings.

Pure Python like the rest of scheduling: the engine hands in its timings and speculative
counts, the scheduler and its block manager give the rest.
"""

from __future__ import annotations

import time

from batchd.engine.outputs import ChunkKind, ChunkStat, StepStats
from batchd.engine.scheduling.schedule import SchedulerOutput
from batchd.engine.scheduling.scheduler import Scheduler


def step_stats(
    sched: Scheduler,
    scheduled: SchedulerOutput,
    *,
    step: int,
    start: float,
    forward_s: float,
    num_outputs: int,
    drafted: int,
    accepted: int,
    totals: tuple[int, int],
    overlap: tuple[float, float],
) -> StepStats:
    """The stats of step number ``step``, begun at ``start`` (perf_counter) and ending now.
    ``totals``: proposed and accepted draft tokens of every step so far; ``overlap``: host
    seconds hidden behind the device's computation, and seconds waited for it."""
    bm = sched.block_manager
    decode_tokens = scheduled.num_decode_tokens
    return StepStats(
        step=step,
        num_scheduled_tokens=scheduled.num_batched_tokens,
        num_prefill_tokens=scheduled.num_batched_tokens - decode_tokens,
        num_decode_tokens=decode_tokens,
        num_seqs=len(scheduled.chunks),
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        num_outputs=num_outputs,
        step_time_s=time.perf_counter() - start,
        forward_time_s=forward_s,
        kv_blocks_used=bm.num_used_blocks,
        kv_blocks_total=bm.num_blocks,
        prefix_cache_hit_rate=bm.hit_rate,
        num_preemptions_total=sched.num_preemptions,
        preempted=[s.request_id for s in scheduled.preempted],
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        num_draft_tokens_total=totals[0],
        num_accepted_tokens_total=totals[1],
        host_overlap_s=overlap[0],
        sync_wait_s=overlap[1],
        chunks=[
            ChunkStat(
                c.seq.request_id,
                ChunkKind.decode if c.is_decode else ChunkKind.prefill,
                c.start,
                c.num_tokens,
                sample=c.seq.sample,
            )
            for c in scheduled.chunks
        ],
    )
