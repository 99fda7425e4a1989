"""Paged decode attention for MLX's CUDA backend: one kernel reading K/V in place.

The gather path (batchd.engine.forward.paged_attention) copies every decode row's
blocks into a contiguous ``[kv_heads * B, T, D]`` per layer before attending, and pads
each group to its longest sequence. On a GPU this kernel reads the blocks where the pool
holds them, through each row's block table, one launch per layer for every decode row.

One thread block per (row, KV head) computes the ``G`` query heads that share the KV
head, so each key and value is read once for the group. Its ``NW`` warps take keys
``warp, warp + NW, ...``; a warp's 32 lanes hold ``D / 32`` contiguous values of the
head each, a dot product is a warp reduction, and each warp keeps an online softmax
(running maximum, sum and weighted values, in float32). The warps' partial results are
combined through shared memory at the end. Scores, softmax and the weighted sum are in
float32 whatever the model's dtype.

Rows are independent, so a prefill row can be expressed too (a row of a chunk is a
decode row of a shorter sequence, as the C kernel treats it); the runner sends decode
rows only, since a long prompt's rows would each re-read the whole prefix where MLX's
fused attention reads it once.

The kernel runs on MLX's CUDA backend only (``mx.fast.cuda_kernel``); a Metal twin
(``mx.fast.metal_kernel``) waits until it can be run and checked on a Mac. Checked
against the gather path on random blocks (tests/engine/forward/test_cuda_paged.py):
on a GPU directly, and here, on the CPU, by compiling the same source with a CUDA
emulation (tests/engine/cuda_emulation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

DISABLE_ENV = "BATCHD_CUDA_PAGED_KERNEL"

# Warps per thread block: 4 keeps the final combine's shared memory (NW * G * D floats)
# within the 48 KB a block gets without opting in for G * D up to 3072.
WARPS = 4
_SHARED_LIMIT = 48 * 1024

INPUT_NAMES = ("q", "k", "v", "tables", "lengths", "scale")
OUTPUT_NAMES = ("out",)

HEADER = """
__device__ __forceinline__ float batchd_to_float(float x) { return x; }
__device__ __forceinline__ float batchd_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float batchd_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void batchd_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void batchd_store(__half* p, float x) { *p = __float2half(x); }
__device__ __forceinline__ void batchd_store(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16(x);
}
"""

# Inputs: q [R, H, D], k/v [KVH, S, D] (the pool's layer, S slots), tables [R, W] int32,
# lengths [R] int32 (keys each row attends: its position + 1), scale [1] float32.
# Template: T (dtype), D (head dim), G (query heads per KV head), BS (block size),
# NW (warps): one compilation per model and dtype. Grid: (32 * NW * KVH, R) threads,
# blocks of 32 * NW.
SOURCE = """
  constexpr int PER = D / 32;
  const int kvh = blockIdx.x;
  const int row = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int width = tables_shape[1];
  const int H = G * k_shape[0];
  const long long slots = k_shape[1];
  const int length = lengths[row];
  const float s = scale[0];
  // A finite "minus infinity": exp of it minus any score is 0, and no inf - inf arises.
  constexpr float LOWEST = -3.0e38f;

  float qv[G][PER];
  float acc[G][PER];
  float m[G];
  float l[G];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = q + ((long long)row * H + kvh * G + g) * D + lane * PER;
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
      qv[g][i] = batchd_to_float(qp[i]) * s;
      acc[g][i] = 0.0f;
    }
    m[g] = LOWEST;
    l[g] = 0.0f;
  }

  for (int t = warp; t < length; t += NW) {
    const long long slot = (long long)tables[(long long)row * width + t / BS] * BS + t % BS;
    const long long base = ((long long)kvh * slots + slot) * D + lane * PER;
    float kf[PER];
    float vf[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
      kf[i] = batchd_to_float(k[base + i]);
      vf[i] = batchd_to_float(v[base + i]);
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
      #pragma unroll
      for (int i = 0; i < PER; ++i) {
        dot += qv[g][i] * kf[i];
      }
      #pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        dot += __shfl_xor_sync(0xffffffff, dot, offset);
      }
      const float top = fmaxf(m[g], dot);
      const float keep = expf(m[g] - top);
      const float p = expf(dot - top);
      l[g] = l[g] * keep + p;
      #pragma unroll
      for (int i = 0; i < PER; ++i) {
        acc[g][i] = acc[g][i] * keep + p * vf[i];
      }
      m[g] = top;
    }
  }

  __shared__ float part_m[NW][G];
  __shared__ float part_l[NW][G];
  __shared__ float part_acc[NW][G][D];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      part_m[warp][g] = m[g];
      part_l[warp][g] = l[g];
    }
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
      part_acc[warp][g][lane * PER + i] = acc[g][i];
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < G * D; idx += NW * 32) {
    const int g = idx / D;
    const int d = idx % D;
    float top = LOWEST;
    #pragma unroll
    for (int w = 0; w < NW; ++w) {
      top = fmaxf(top, part_m[w][g]);
    }
    float total = 0.0f;
    float value = 0.0f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float weight = expf(part_m[w][g] - top);
      total += part_l[w][g] * weight;
      value += part_acc[w][g][d] * weight;
    }
    const float result = total > 0.0f ? value / total : 0.0f;
    batchd_store(out + ((long long)row * H + kvh * G + g) * D + d, result);
  }
"""


@dataclass(frozen=True)
class KernelShape:
    """What a model's attention must look like for the kernel, and why not otherwise."""

    heads: int
    kv_heads: int
    head_dim: int

    def problem(self) -> str | None:
        """Why the kernel cannot take this shape, or None."""
        if self.head_dim % 32 or self.head_dim > 256:
            return f"head_dim {self.head_dim} is not a multiple of 32 up to 256"
        if self.heads % self.kv_heads:
            return f"{self.heads} heads do not share {self.kv_heads} KV heads evenly"
        group = self.heads // self.kv_heads
        if WARPS * group * self.head_dim * 4 > _SHARED_LIMIT:
            return f"{group} query heads per KV head of {self.head_dim} need too much shared memory"
        return None


def problem(shape: KernelShape | None, *, quantized_kv: bool) -> str | None:
    """Why the kernel cannot run here for this model, or None when it can (``shape``
    None: not known yet, so only the machine and the pool are asked)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0 asks for the gather path"
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return "the paged kernel runs on MLX's CUDA backend only"
    if quantized_kv:
        return "a quantized KV pool is read through the gather path"
    return None if shape is None else shape.problem()


_kernel: object | None = None


def _compiled() -> object:
    """The kernel object, made once (MLX compiles it per template on first use)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="batchd_paged_decode",
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            source=SOURCE,
            header=HEADER,
        )
    return _kernel


def launch(
    q: mx.array, k: mx.array, v: mx.array, tables: mx.array, lengths: mx.array, *, block_size: int
) -> tuple[tuple[int, int, int], tuple[int, int, int], list[tuple[str, int | mx.Dtype]]]:
    """Grid, thread block and template arguments of one call (shared with the tests)."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[0]
    template: list[tuple[str, int | mx.Dtype]] = [
        ("T", q.dtype),
        ("D", dim),
        ("G", heads // kv_heads),
        ("BS", block_size),
        ("NW", WARPS),
    ]
    return (32 * WARPS * kv_heads, rows, 1), (32 * WARPS, 1, 1), template


def paged_decode(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    tables: mx.array,
    lengths: mx.array,
    scale: mx.array,
    *,
    block_size: int,
) -> mx.array:
    """Attention of rows ``q [R, heads, D]`` over a layer's pool ``k``/``v [kv_heads,
    slots, D]``, each row reading ``lengths[r]`` keys through ``tables[r]``;
    ``scale``: a float32 array of one value. Returns ``[R, heads * D]``, lazily."""
    if k.dtype != q.dtype:
        q = q.astype(k.dtype)
    grid, block, template = launch(q, k, v, tables, lengths, block_size=block_size)
    kernel = _compiled()
    (out,) = kernel(  # type: ignore[operator]
        inputs=[q, k, v, tables, lengths, scale],
        template=template,
        grid=grid,
        threadgroup=block,
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    rows, heads, dim = q.shape
    result: mx.array = out.reshape(rows, heads * dim)
    return result
