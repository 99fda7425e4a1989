"""Async scheduling: step N+1's forward starts before the host reads step N's ids.

The synchronous step (``LLMEngine._run``) schedules, launches the forward, waits for
the sampled ids, then updates the scheduler; the next step's scheduling and inputs
(block tables, positions, slots) are built only after that wait, while the device
idles. Here, as in mlx-lm's BatchGenerator, a step of decode rows is followed by the
next one before its ids are read: the scheduler takes step N's outputs as if none
stops (a stand-in token, ``PENDING``, holds each row's place), schedules step N+1,
whose forward reads step N's sampled ids as a lazy MLX array, launches it
(``mx.async_eval``), and only then reads step N's ids. The stand-ins are replaced by
the real ids before anything reads them, and step N's outputs are emitted as the
synchronous step emits them. A row that ends at step N (stop token or string,
max_tokens, abort) has one wasted row in step N+1: its result is dropped, and its
blocks went back when it finished (vLLM's async scheduling does the same).

Only a step whose next inputs need no host decision is followed this way: every
running sequence decodes (no prefill chunk, no waiting sequence that could be admitted
now, no preemption needed for the next step's blocks), and every row samples plainly: no
grammar (its mask needs the token), no speculative decoding (its proposals read the
tokens), no penalties (their counts are kept on the host from the read ids), no
prompt logprobs. Any other step runs synchronously, so a decode-heavy batch pipelines
in its steady state and falls back for the step after a prompt arrives. Seeded draws
stay a function of (seed, output position) and greedy rows take the same argmax, so
the tokens are the synchronous step's (logprobs to float32 rounding: a request that
arrives while a step is in flight joins a step later, so rows share other batches).

It runs on the mlx backend with the device sampler (the native_cpu backend evaluates
its forward layer by layer on the host, and the host sampler reads the whole logits:
neither can leave a step in flight). docs/engine.md, "Async scheduling".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.config import EngineConfig
from batchd.engine.forward.backend import MLX, BackendChoice
from batchd.engine.forward.generic_runner import GenericRunner
from batchd.engine.forward.model_runner import ModelRunner
from batchd.engine.outputs import RequestOutput, StepStats
from batchd.engine.request_state import RequestState
from batchd.engine.sampler import SampleRow
from batchd.engine.sampling import device
from batchd.engine.sampling.rows import may_speculate
from batchd.engine.sampling.samplers import DEVICE
from batchd.engine.scheduling.schedule import SchedulerOutput
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)

# The token a sequence holds for a sampled id not read yet; replaced before any read.
PENDING = -1


class LLMEngine(Protocol):
    """What the async step uses of :class:`batchd.engine.llm_engine.LLMEngine` (which
    imports this module: the engine is described here, not imported)."""

    config: EngineConfig
    backend: BackendChoice
    runner: ModelRunner | GenericRunner
    scheduler: Scheduler
    last_step_stats: StepStats
    _live: dict[str, dict[int, Sequence]]
    _states: dict[str, RequestState]
    _prompt_logprobs: dict[str, list[float]]

    def _schedule(self) -> SchedulerOutput: ...

    def _run(self, scheduled: SchedulerOutput, start: float) -> list[RequestOutput]: ...

    def _output(
        self,
        seq: Sequence,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None,
    ) -> RequestOutput: ...

    def _stats(
        self,
        scheduled: SchedulerOutput,
        start: float,
        forward_s: float,
        num_outputs: int,
        drafted: int = 0,
        accepted: int = 0,
        overlap: tuple[float, float] = (0.0, 0.0),
    ) -> StepStats: ...


@dataclass
class _InFlight:
    """A launched decode step: its chunks (one row each, in row order) and lazy draw.
    ``committed``: the scheduler already counts its outputs (stand-ins in place), since
    the next step was scheduled behind it."""

    scheduled: SchedulerOutput
    draw: device.DeviceDraw
    launched_at: float  # perf_counter() when its evaluation was started
    committed: bool = False


class AsyncSteps:
    """The engine's steps with the next decode step launched before this one is read."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._runner = engine.runner
        self._in_flight: _InFlight | None = None
        # Steps launched behind an unread one (tests check the overlap happens).
        self.num_overlapped = 0

    def step(self, start: float) -> list[RequestOutput]:
        """One step's outputs: those of the step in flight (launching the next one first
        when it may), or of a step scheduled now."""
        eng = self.engine
        current = self._in_flight
        self._in_flight = None
        if current is None:
            scheduled = eng._schedule()
            if not self._plain(scheduled):
                return eng._run(scheduled, start)
            current = self._launch(scheduled, None, ahead=0)
        hidden_s = 0.0  # host time building the next step while this one computed
        if self._may_follow(current):
            began = time.perf_counter()
            self._in_flight = self._follow(current)
            hidden_s = self._in_flight.launched_at - began
        return self._finish(current, start, hidden_s)

    # -- which steps pipeline ----------------------------------------------------------------

    def _plain(self, scheduled: SchedulerOutput) -> bool:
        """Every chunk a one-token decode of a row that samples plainly."""
        eng = self.engine
        if scheduled.is_empty or scheduled.preempted:
            return False
        for c in scheduled.chunks:
            if c.num_tokens != 1 or not c.samples or c.draft:
                return False
            state = eng._states[c.seq.seq_id]
            params = state.params
            if state.matcher is not None or params.penalises_recent:
                return False
            if c.seq.seq_id in eng._prompt_logprobs:
                return False
            if may_speculate(state, eng.config.speculative):
                return False
        return True

    def _may_follow(self, current: _InFlight) -> bool:
        """Whether the next step is known now: the same rows decode again, nothing can be
        admitted (none waits, or the running cap is reached: a row that ends at this step
        makes room a step later), and the free blocks hold every row's next position."""
        sched, eng = self.engine.scheduler, self.engine
        live = [c for c in current.scheduled.chunks if self._owned(c.seq)]
        if not live or len(live) != sched.num_running:
            return False
        if sched.num_waiting and sched.num_running < eng.config.max_num_seqs:
            return False
        if not self._plain(SchedulerOutput(chunks=live)):
            return False
        bm = sched.block_manager
        needed = sum(bm.num_new_blocks(c.seq, c.start + 2) for c in live)
        return needed <= bm.num_free_blocks and len(live) <= eng.config.max_num_batched_tokens

    # -- launching -------------------------------------------------------------------------

    def _follow(self, current: _InFlight) -> _InFlight:
        """Count ``current``'s outputs with stand-ins, schedule the next step and launch
        it on ``current``'s sampled ids (lazy)."""
        eng = self.engine
        rows = {c.seq.seq_id: row for row, c in enumerate(current.scheduled.chunks)}
        eng.scheduler.update(
            current.scheduled,
            {c.seq.seq_id: PENDING for c in current.scheduled.chunks if self._owned(c.seq)},
        )
        current.committed = True
        scheduled = eng._schedule()
        if not self._plain(scheduled) or any(c.seq.seq_id not in rows for c in scheduled.chunks):
            raise RuntimeError(
                f"async scheduling: the step after {sorted(rows)} was expected to decode the "
                f"same rows, got {[(c.seq.seq_id, c.num_tokens) for c in scheduled.chunks]}"
            )
        index = np.asarray([rows[c.seq.seq_id] for c in scheduled.chunks], dtype=np.int32)
        fed = current.draw.token_ids[mx.array(index)]
        self.num_overlapped += 1
        return self._launch(scheduled, fed, ahead=1)

    def _launch(self, scheduled: SchedulerOutput, fed: mx.array | None, *, ahead: int) -> _InFlight:
        """Build the step's forward and draw and start computing them. ``ahead``: outputs
        each row will have emitted before this step's (1 when the previous step is still
        unread)."""
        assert isinstance(self._runner, ModelRunner)
        logits, _ = self._runner.execute_scored(scheduled.chunks, {}, fed)
        assert logits is not None, "a decode step samples"
        rows = [self._row(c.seq, ahead) for c in scheduled.chunks]
        drawn = device.draw(logits, device.prepare(rows, logits.shape[-1]))
        launched_at = time.perf_counter()
        device.launch(drawn)
        return _InFlight(scheduled, drawn, launched_at)

    def _row(self, seq: Sequence, ahead: int) -> SampleRow:
        """A plain row's sampling inputs at its output position ``ahead`` past the next."""
        state = self.engine._states[seq.seq_id]
        position = state.num_outputs + ahead
        return SampleRow(state.params, state.seed, position, None, tuple(state.banned_after(ahead)))

    # -- reading ---------------------------------------------------------------------------

    def _finish(self, done: _InFlight, start: float, hidden_s: float) -> list[RequestOutput]:
        """Read ``done``'s ids (the step's one wait), put them in the scheduler's place
        and emit them; rows whose sequence ended meanwhile are dropped."""
        eng = self.engine
        waited = time.perf_counter()
        ids, logprobs, top = device.read(done.draw)
        wait_s = time.perf_counter() - waited
        live = [(row, c) for row, c in enumerate(done.scheduled.chunks) if self._owned(c.seq)]
        if done.committed:
            for row, c in live:
                c.seq.set_token(c.start + 1, ids[row])
        else:
            eng.scheduler.update(done.scheduled, {c.seq.seq_id: ids[row] for row, c in live})
        outputs = [eng._output(c.seq, ids[row], logprobs[row], top[row]) for row, c in live]
        forward_s = time.perf_counter() - start
        eng.last_step_stats = eng._stats(
            done.scheduled, start, forward_s, len(outputs), overlap=(hidden_s, wait_s)
        )
        return outputs

    def _owned(self, seq: Sequence) -> bool:
        """Whether ``seq`` is still live in the engine (not finished or aborted since)."""
        return self.engine._live.get(seq.request_id, {}).get(seq.sample) is seq


def async_steps(engine: LLMEngine) -> AsyncSteps | None:
    """The engine's async stepping when its config asks and its backend allows, else None
    (the reason logged)."""
    if not engine.config.async_scheduling:
        return None
    backend = engine.backend
    if (
        backend.name != MLX
        or backend.sampler != DEVICE
        or not isinstance(engine.runner, ModelRunner)
    ):
        log.warning(
            "async scheduling off: it needs the mlx backend, the device sampler and the "
            "engine's own runner (here %s)",
            backend.describe(),
        )
        return None
    log.info("async scheduling: decode steps launch before the previous step is read")
    return AsyncSteps(engine)


__all__ = ["PENDING", "AsyncSteps", "async_steps"]
