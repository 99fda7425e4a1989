"""Where a step's rows are sampled: on the device (MLX ops) or on the host (NumPy).

The engine holds one :class:`Sampler`, chosen at start with the forward backend
(batchd.engine.forward.backend), and calls it the same way whatever computed the
logits: ``begin`` as soon as the forward's graph is built (evaluation starts, the
host goes on building the step's sampling rows: grammar masks, penalties), then
``sample``, which waits once. The device sampler waits for the chosen ids only (a few
bytes a row, and the top logprobs of rows that asked); the host sampler waits for the
whole ``[rows, vocab]`` logits and samples them with NumPy: the C kernels' logits are
on the host already, and their decode steps measured shorter with it than with MLX's
ops on the CPU (docs/bench/HISTORY.md, "Forward backends").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.sampler import SampleRow, Samples, sample
from batchd.engine.sampling import device

DEVICE = "device"
HOST = "host"
SAMPLERS = (DEVICE, HOST)


class Sampler(Protocol):
    """One step's sampling, in three calls: ``begin`` with the (lazy) logits and what
    else the step evaluates (``extra``: prompt logprobs), ``prepare`` with the rows
    while the device computes, ``sample`` (the one wait). ``wait_s`` is how long the
    last ``sample`` blocked on the device."""

    name: str
    wait_s: float

    def begin(self, logits: mx.array, extra: Sequence[mx.array]) -> None: ...

    def prepare(self, rows: Sequence[SampleRow]) -> None: ...

    def sample(self) -> Samples: ...


class _Started:
    """What both samplers share: evaluation of the logits starts at ``begin``."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        self._logits: mx.array | None = None
        self._extra: Sequence[mx.array] = ()

    def begin(self, logits: mx.array, extra: Sequence[mx.array]) -> None:
        mx.async_eval(logits, *extra)  # type: ignore[no-untyped-call]
        self._logits, self._extra = logits, extra

    def _started(self) -> mx.array:
        if self._logits is None:
            raise RuntimeError("sample() before begin(): no logits to sample")
        logits, self._logits = self._logits, None
        return logits


class DeviceSampler(_Started):
    """MLX ops on the logits' device (batchd.engine.sampling.device): one sync a step."""

    name = DEVICE

    def prepare(self, rows: Sequence[SampleRow]) -> None:
        assert self._logits is not None
        self._batch = device.prepare(rows, self._logits.shape[-1])

    def sample(self) -> Samples:
        drawn = device.draw(self._started(), self._batch)
        start = time.perf_counter()
        tokens, logprobs, top = device.read(drawn, *self._extra)
        self.wait_s = time.perf_counter() - start
        return Samples(token_ids=tokens, logprobs=logprobs, top_logprobs=top)


class HostSampler(_Started):
    """The logits copied to the host and sampled with NumPy (batchd.engine.sampler)."""

    name = HOST

    def prepare(self, rows: Sequence[SampleRow]) -> None:
        self._rows = rows

    def sample(self) -> Samples:
        logits = self._started()
        start = time.perf_counter()
        full = logits if logits.dtype == mx.float32 else logits.astype(mx.float32)
        mx.eval(full, *self._extra)
        host = np.asarray(full)
        self.wait_s = time.perf_counter() - start
        return sample(host, self._rows)


def make_sampler(name: str) -> Sampler:
    """The sampler called ``name`` (one of SAMPLERS)."""
    if name == DEVICE:
        return DeviceSampler()
    if name == HOST:
        return HostSampler()
    raise ValueError(f"sampler {name!r}: expected one of {', '.join(SAMPLERS)}")
