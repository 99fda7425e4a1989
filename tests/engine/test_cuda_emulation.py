"""The CPU emulator of `mx.fast.cuda_kernel` bodies agrees with numpy on known kernels.

It is the only check of the CUDA paged-attention kernel's logic before a GPU is
available, so each feature that kernel leans on (thread indexing, shared memory and
__syncthreads, warp shuffles, 16-bit float conversions) is pinned here against numpy.
"""

from __future__ import annotations

import shutil

import batchd.engine.preload  # noqa: F401

import mlx.core as mx
import numpy as np
import pytest
from cuda_emulation.emulate import bf16_round, run_kernel
from cuda_emulation.nvrtc_check import DEMO
from cuda_emulation.spec import KernelSpec

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")

# The elementwise example of mx.fast.cuda_kernel's docstring, as the NVRTC check's demo.
ELEMENTWISE = DEMO

# One block per row; a shared-memory tree sum. DYN picks `extern __shared__` storage.
BLOCK_SUM = """
    constexpr int N = 128;
    __shared__ float fixed[N];
    extern __shared__ float dynamic[];
    float* buf = DYN ? dynamic : fixed;
    int row = blockIdx.y;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < x_shape[1]; i += N) acc += x[row * x_shape[1] + i];
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int s = N / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) out[row] = buf[0];
"""

# Each warp sums its 32 values with a butterfly; every lane must end with the total.
WARP_SUM = """
    uint32_t gid = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[gid];
    for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffff, v, mask);
    float first = __shfl_sync(0xffffffff, v, 0);
    float next = __shfl_down_sync(0xffffffff, x[gid], 1);
    out[gid] = (first == v) ? v : -1.0f;
    shifted[gid] = next;
"""


def test_elementwise_matches_numpy_and_leaves_unlaunched_elements_unwritten() -> None:
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    (out,) = run_kernel(ELEMENTWISE, {"inp": x}, [(1002,)], (1000, 1, 1), (256, 1, 1))
    np.testing.assert_allclose(out[:1000], np.exp(x), rtol=1e-6)
    assert np.isnan(out[1000:]).all()  # outputs start as NaN: a missed store is visible


@pytest.mark.parametrize("dynamic", [False, True])
def test_block_reduction_with_shared_memory_and_syncthreads(dynamic: bool) -> None:
    spec = KernelSpec(
        name="rowsum",
        inputs=(("x", "float32"),),
        outputs=(("out", "float32"),),
        template=(("DYN", dynamic),),
        source=BLOCK_SUM,
    )
    x = np.random.default_rng(1).standard_normal((5, 300)).astype(np.float32)
    smem = 128 * 4 if dynamic else 0
    (out,) = run_kernel(spec, {"x": x}, [(5,)], (128, 5, 1), (128, 1, 1), shared_memory=smem)
    np.testing.assert_allclose(out, x.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_warp_shuffles_reduce_and_shift_like_a_gpu_warp() -> None:
    spec = KernelSpec(
        name="warpsum",
        inputs=(("x", "float32"),),
        outputs=(("out", "float32"), ("shifted", "float32")),
        source=WARP_SUM,
    )
    x = np.arange(128, dtype=np.float32)
    out, shifted = run_kernel(spec, {"x": x}, [(128,), (128,)], (128, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out, np.repeat(x.reshape(4, 32).sum(axis=1), 32))
    # __shfl_down_sync past the warp's last lane returns the caller's own value.
    want = x.reshape(4, 32).copy()
    want[:, :-1] = want[:, 1:]
    np.testing.assert_array_equal(shifted, want.ravel())


def test_bf16_and_fp16_conversions_round_like_mlx() -> None:
    spec = KernelSpec(
        name="cvt",
        inputs=(("x", "float32"), ("b", "bfloat16")),
        outputs=(
            ("via_intrinsic", "bfloat16"),
            ("via_cast", "bfloat16"),
            ("h", "float16"),
            ("back", "float32"),
        ),
        source="""
            uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i >= x_shape[0]) return;
            via_intrinsic[i] = __float2bfloat16(x[i]);
            via_cast[i] = static_cast<__nv_bfloat16>(x[i]);
            h[i] = __float2half(x[i]);
            back[i] = __bfloat162float(b[i]) + static_cast<float>(__half2float(h[i])) * 0.0f;
        """,
    )
    rng = np.random.default_rng(2)
    # Exact ties between two bf16 neighbours (both parities) plus ordinary values.
    ties = (np.arange(1, 65, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    x = np.concatenate([ties, rng.standard_normal(448).astype(np.float32) * 100])
    n = x.size
    outs = run_kernel(spec, {"x": x, "b": x}, [(n,)] * 4, (n, 1, 1), (128, 1, 1))
    want = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(outs[0], want)
    np.testing.assert_array_equal(outs[1], want)
    np.testing.assert_array_equal(outs[2], x.astype(np.float16))
    np.testing.assert_array_equal(outs[3], bf16_round(x))
    np.testing.assert_array_equal(bf16_round(x), want)


def test_a_barrier_not_every_thread_reaches_is_reported_not_hung() -> None:
    spec = KernelSpec(
        name="stuck",
        inputs=(("x", "float32"),),
        outputs=(("out", "float32"),),
        source="if (threadIdx.x == 0) __syncthreads(); else __syncwarp(); out[0] = x[0];",
    )
    with pytest.raises(RuntimeError, match="deadlock"):
        run_kernel(
            spec,
            {"x": np.ones(1, np.float32)},
            [(1,)],
            (64, 1, 1),
            (64, 1, 1),
            deadlock_seconds=0.3,
        )
