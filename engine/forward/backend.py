"""Which forward computes a step's logits, chosen once at start, and why.

Two backends behind one contract (the runner's ``execute_scored``: a step's chunks
in, logits ``mx.array [rows, vocab]`` out):

- ``mlx``: MLX ops on MLX's default device (Metal, CUDA or the CPU): the paged
  gathers of batchd.engine.forward.paged_attention, lazily, one evaluation a step.
  Its logits are sampled on the same device (batchd.engine.sampling.device).
- ``native_cpu``: the C kernels of batchd.engine.forward.native (x86 CPUs, float32
  models, a float KV pool), evaluated layer by layer on the host; its logits are
  already on the host and are sampled there with NumPy.

``auto`` takes ``native_cpu`` where it can run and was not switched off
(``BATCHD_NATIVE_ATTENTION=0``), ``mlx`` otherwise; the reason is logged at start,
shown by ``batchd doctor`` and exported as a metric label.

On the ``mlx`` backend, decode attention reads the pool either through gathers
(``gather``, everywhere) or, on a CUDA GPU, through the paged kernel of
batchd.engine.forward.cuda_paged (``cuda_paged``), where the model's shape allows it;
on a CUDA GPU its prefill chunks are padded to bucketed shapes
(batchd.engine.forward.prefill_buckets).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.engine.forward import cuda_paged, cuda_paged_check, fast_math, native, prefill_buckets
from batchd.engine.forward.cuda_paged import KernelShape
from batchd.engine.sampling.samplers import DEVICE, HOST, SAMPLERS

AUTO = "auto"
MLX = "mlx"
NATIVE_CPU = "native_cpu"
BACKENDS = (AUTO, MLX, NATIVE_CPU)

# How the mlx backend's decode attention reads the KV pool.
GATHER = "gather"
CUDA_PAGED = "cuda_paged"


@dataclass(frozen=True)
class BackendChoice:
    """The forward backend, the sampler it feeds, and why, in a line."""

    name: str
    sampler: str
    reason: str
    # The mlx backend's decode attention (GATHER or CUDA_PAGED) and why; None on native_cpu.
    attention: str | None = None
    attention_reason: str = ""
    # The mlx backend's prefill chunks padded to bucketed shapes (prefill_buckets).
    prefill_buckets: bool = False

    def describe(self) -> str:
        text = f"{self.name} (sampling on the {self.sampler}): {self.reason}"
        if self.attention is not None:
            text += f"; decode attention: {self.attention} ({self.attention_reason})"
        if self.prefill_buckets:
            text += "; prefill attention at bucketed shapes (each built once)"
        return text


def native_problem(*, dtype: mx.Dtype | None, quantized_kv: bool, generic: bool) -> str | None:
    """Why the C kernels cannot run this model here, or None when they can (``dtype``
    None: not known yet, as for ``batchd doctor``)."""
    if mx.default_device() != mx.cpu:
        return f"MLX runs on the {mx.default_device()}, the C kernels on an x86 CPU only"
    if not fast_math.enabled():
        return f"{fast_math.DISABLE_ENV}=1 asks for MLX's own kernels"
    if generic:
        return "the model's architecture runs through mlx-lm's own forward"
    if dtype is not None and dtype != mx.float32:
        return f"the C kernels take float32 models, this one computes in {dtype}"
    if quantized_kv:
        return "a quantized KV pool is read by MLX's ops only"
    if os.environ.get(native.DISABLE_ENV) == "0":
        return f"{native.DISABLE_ENV}=0 asks for MLX's path"
    if not native.available():
        return f"C kernels unavailable: {native.describe()}"
    return None


def choose(
    requested: str,
    sampler: str = AUTO,
    *,
    dtype: mx.Dtype | None,
    quantized_kv: bool = False,
    generic: bool = False,
    shape: KernelShape | None = None,
) -> BackendChoice:
    """The backend for ``requested`` (one of BACKENDS) and the sampler for ``sampler``
    (``auto``, or one of SAMPLERS); ValueError for ``native_cpu`` where it cannot run.
    ``shape``: the model's attention heads, for the choice of decode attention (None:
    not known, as for ``batchd doctor``)."""
    if requested not in BACKENDS:
        raise ValueError(f"forward backend {requested!r}: expected one of {', '.join(BACKENDS)}")
    if sampler != AUTO and sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r}: expected auto or one of {', '.join(SAMPLERS)}")
    problem = native_problem(dtype=dtype, quantized_kv=quantized_kv, generic=generic)
    if requested == NATIVE_CPU and problem is not None:
        raise ValueError(f"forward backend native_cpu cannot run here: {problem}")
    if requested == MLX:
        name, reason = MLX, "asked for (forward_backend = mlx)"
    elif problem is None:
        name = NATIVE_CPU
        reason = "asked for" if requested == NATIVE_CPU else "C kernels built for this CPU"
    else:
        name, reason = MLX, problem
    if sampler == AUTO:
        sampler = HOST if name == NATIVE_CPU else DEVICE
    if name == NATIVE_CPU:
        return BackendChoice(name, sampler, reason)
    attention, why = _decode_attention(
        shape, dtype=dtype or mx.float32, quantized_kv=quantized_kv, generic=generic
    )
    buckets = not generic and prefill_buckets.enabled()
    return BackendChoice(name, sampler, reason, attention, why, buckets)


def _decode_attention(
    shape: KernelShape | None, *, dtype: mx.Dtype, quantized_kv: bool, generic: bool
) -> tuple[str, str]:
    """The mlx backend's decode attention and why (the paged kernel only once it has run
    correctly here: cuda_paged_check)."""
    if generic:
        return GATHER, "mlx-lm's own forward attends"
    problem = cuda_paged.problem(shape, quantized_kv=quantized_kv)
    if problem is None and shape is None:  # batchd doctor: no model yet
        return CUDA_PAGED, (
            "on the CUDA GPU, for models with head dims a multiple of 32 up to 256 that pass "
            "the kernel's start-up check"
        )
    if problem is None and shape is not None:
        problem = cuda_paged_check.self_check(shape, dtype)
    if problem is not None:
        return GATHER, problem
    return CUDA_PAGED, "the paged kernel reads KV blocks in place on the CUDA GPU"
