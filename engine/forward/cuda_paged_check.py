"""The paged CUDA kernel's start-up check: run it once here before trusting it.

batchd.engine.forward.backend chooses the kernel only after it has been built and run on
this machine and agreed with the gather path's attention on a small random case: a CUDA install
without the headers MLX compiles kernels with, or a driver that refuses the kernel, then
shows at start (the reason logged and shown by ``batchd doctor``), and decode attention
takes the gather path instead of failing the first step that has a decode row.
"""

from __future__ import annotations

import math

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.forward import cuda_paged
from batchd.engine.forward.cuda_paged import KernelShape
from batchd.engine.forward.paged_attention import decode_attention, make_decode_group

# max |kernel - gather| / max |gather| above this is a wrong kernel, not rounding:
# bfloat16 inputs, and MLX's CUDA float32 products in TF32, stay well below it.
TOLERANCE = 2e-2


def self_check(shape: KernelShape, dtype: mx.Dtype) -> str | None:
    """Run the kernel once on a small random case against the gather path
    (batchd.engine.forward.paged_attention): why it cannot be used here (it failed to
    build or run, or it disagrees), or None."""
    bs, lengths, scale = 16, [37, 5], shape.head_dim**-0.5
    kq, kk, kv = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((2, shape.heads, shape.head_dim), key=kq).astype(dtype)
    k = mx.random.normal((shape.kv_heads, 6 * bs, shape.head_dim), key=kk).astype(dtype)
    v = mx.random.normal((shape.kv_heads, 6 * bs, shape.head_dim), key=kv).astype(dtype)
    tables = [[4, 1, 3], [2]]
    padded = mx.array([[4, 1, 3], [2, 0, 0]], dtype=mx.int32)
    try:
        out = cuda_paged.paged_decode(
            q,
            k,
            v,
            padded,
            mx.array(lengths, dtype=mx.int32),
            mx.array([scale], dtype=mx.float32),
            block_size=bs,
        )
        group = make_decode_group(0, tables, lengths, block_size=bs, num_kv_heads=shape.kv_heads)
        blocks = (shape.kv_heads, 6, bs, shape.head_dim)
        gathered = decode_attention(q, k.reshape(blocks), v.reshape(blocks), group, scale=scale)
        want = gathered.astype(mx.float32)
        ratio = mx.abs(out.astype(mx.float32) - want).max() / mx.abs(want).max()
        error = float(np.array(ratio))
    except Exception as exc:  # any failure to build or run it means: do not use it
        return f"the paged kernel failed its start-up check ({type(exc).__name__}: {exc})"
    if not math.isfinite(error) or error > TOLERANCE:
        return f"the paged kernel's start-up check differs from the gather path ({error:.2g})"
    return None
