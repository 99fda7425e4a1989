"""The peers batchd is measured against, all on mlx-lm's own model code.

- BatchGenerator: mlx-lm's continuous batcher, the one a Mac user already has.
- sequential: each request alone through ``generate_step`` (the seeds' baseline).
- static batching: waves of up to ``batch_size`` requests, left-padded to the
  wave's longest prompt, decoded until the wave's longest output, with a
  barrier between waves.

All run greedy and ignore EOS: they stop at each request's ``max_tokens``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load

from batchd.daemon.bench.stats import Recorder, RunStats
from batchd.daemon.bench.workloads import Request, Workload

# Static batching prefills a wave in column chunks of this many tokens, so a
# wave of 32 long prompts does not build one huge attention matrix.
_STATIC_PREFILL_CHUNK = 256


def load_model(path: Path) -> Any:
    """mlx-lm's model for ``path`` (the tokenizer is not needed: prompts are ids)."""
    loaded = load(str(path))
    return loaded[0]


class BatchGeneratorSystem:
    """mlx-lm's BatchGenerator as a step system (see batchd.daemon.bench.drive)."""

    def __init__(self, model: Any, *, completion_batch_size: int) -> None:
        # No stop tokens: runs to max_tokens, like batchd with ignore_eos.
        self._gen = BatchGenerator(model, completion_batch_size=completion_batch_size)
        self._ids: dict[int, str] = {}
        self._unfinished = 0

    def add(self, request: Request) -> None:
        (uid,) = self._gen.insert([request.prompt_ids], max_tokens=[request.max_tokens])
        self._ids[uid] = request.request_id
        self._unfinished += 1

    def step(self) -> list[tuple[str, int, bool]]:
        _, responses = self._gen.next()
        advanced = []
        for response in responses:
            finished = response.finish_reason is not None
            self._unfinished -= finished
            advanced.append((self._ids[response.uid], 1, finished))
        return advanced

    def has_unfinished(self) -> bool:
        return self._unfinished > 0

    def close(self) -> None:
        self._gen.close()


def run_sequential(model: Any, workload: Workload, recorder: Recorder) -> RunStats:
    """Each request alone, one after another; all arrive at t=0."""
    for request in workload.requests:
        recorder.arrive(request.request_id)
    for request in workload.requests:
        steps = generate_step(mx.array(request.prompt_ids), model, max_tokens=request.max_tokens)
        for n, _ in enumerate(steps, start=1):
            recorder.token(request.request_id, finished=n == request.max_tokens)
    return recorder.result()


def run_static(model: Any, workload: Workload, recorder: Recorder, *, batch_size: int) -> RunStats:
    """Waves of ``batch_size`` requests in order; a wave starts when the last one ends."""
    for request in workload.requests:
        recorder.arrive(request.request_id)
    for start in range(0, len(workload.requests), batch_size):
        _run_wave(model, workload.requests[start : start + batch_size], recorder)
    return recorder.result()


def _run_wave(model: Any, wave: list[Request], recorder: Recorder) -> None:
    longest = max(len(r.prompt_ids) for r in wave)
    padding = [longest - len(r.prompt_ids) for r in wave]
    tokens = mx.array([[0] * pad + r.prompt_ids for pad, r in zip(padding, wave, strict=True)])
    cache = [BatchKVCache(padding) for _ in model.layers]
    for col in range(0, longest, _STATIC_PREFILL_CHUNK):
        logits = model(tokens[:, col : col + _STATIC_PREFILL_CHUNK], cache=cache)
        if col + _STATIC_PREFILL_CHUNK < longest:
            mx.eval([c.state for c in cache])
    y = mx.argmax(logits[:, -1, :], axis=-1)
    steps = max(r.max_tokens for r in wave)
    for step in range(steps):
        if step + 1 < steps:
            # Queue the next step before reading this one, as mlx-lm does.
            next_y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(next_y)
        mx.eval(y)
        for request in wave:
            if step < request.max_tokens:
                recorder.token(request.request_id, finished=step + 1 == request.max_tokens)
        if step + 1 < steps:
            y = next_y
