"""The C products over packed weights, RMSNorm and RoPE with the pool's writes
(engine/forward/products.c, rows.c) against NumPy and MLX, and the packing rules."""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchd.engine.forward import native
from batchd.engine.forward.packed_model import pack_model
from batchd.engine.models.loader import load

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler here: the kernels cannot be built"
)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _silu_glu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gate / (1.0 + np.exp(-gate.astype(np.float64))).astype(np.float32) * up


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (7, 100, 70), (33, 96, 200), (70, 48, 5)])
def test_product_matches_numpy_with_and_without_bias(m: int, k: int, n: int, threads: int) -> None:
    rng = _rng(m * n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    np.testing.assert_allclose(
        native.product(x, native.pack(w), threads=threads), x @ w, rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        native.product(x, native.pack(w, b), threads=threads), x @ w + b, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("n", [16, 40, 1536])
def test_swiglu_product_writes_silu_of_gate_times_up(n: int) -> None:
    rng = _rng(n)
    gate, up = (rng.standard_normal((96, n)).astype(np.float32) * 0.3 for _ in range(2))
    biases = (rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32))
    x = rng.standard_normal((9, 96)).astype(np.float32)
    got = native.product(x, native.pack_swiglu(gate, up), threads=2)
    np.testing.assert_allclose(got, _silu_glu(x @ gate, x @ up), rtol=1e-4, atol=1e-4)
    got = native.product(x, native.pack_swiglu(gate, up, biases), threads=2)
    expected = _silu_glu(x @ gate + biases[0], x @ up + biases[1])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_a_row_comes_out_the_same_in_any_batch_and_thread_count() -> None:
    """Each output is one ordered sum: a sequence's logits do not depend on its batch."""
    rng = _rng(5)
    weight = native.pack(rng.standard_normal((576, 300)).astype(np.float32))
    x = rng.standard_normal((40, 576)).astype(np.float32)
    batch = native.product(x, weight, threads=2)
    for row in (0, 13, 39):
        alone = native.product(x[row : row + 1], weight, threads=1)
        assert np.array_equal(alone[0], batch[row])
    assert np.array_equal(native.product(x[5:29], weight, threads=3), batch[5:29])


def test_product_refuses_mismatched_shapes_and_types() -> None:
    weight = native.pack(np.ones((8, 4), np.float32))
    with pytest.raises(native.KernelError, match="columns"):
        native.product(np.ones((2, 9), np.float32), weight, threads=1)
    with pytest.raises(native.KernelError, match="float32"):
        native.product(np.ones((2, 8), np.float64), weight, threads=1)
    with pytest.raises(native.KernelError, match="differ in shape"):
        native.pack_swiglu(np.ones((8, 4), np.float32), np.ones((8, 5), np.float32))
    assert native.product(np.ones((0, 8), np.float32), weight, threads=2).shape == (0, 4)


def test_rms_norm_matches_mlx() -> None:
    rng = _rng(3)
    x = rng.standard_normal((5, 96)).astype(np.float32) * 3
    w = rng.standard_normal(96).astype(np.float32)
    expected = np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-5))
    np.testing.assert_allclose(native.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_rotates_as_mlx_and_writes_only_the_given_slots(
    traditional: bool, qk_norm: bool
) -> None:
    heads, kv_heads, dim, n, pool_slots = 4, 2, 16, 5, 64
    rng = _rng(int(traditional) * 2 + int(qk_norm))
    qkv = rng.standard_normal((n, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    positions = mx.array(np.array([0, 3, 17, 200, 4095], dtype=np.int32))
    rope = nn.RoPE(dim, traditional=traditional, base=10000.0)
    basis = np.zeros(dim, np.float32)
    if traditional:
        basis[0::2] = 1.0
    else:
        basis[: dim // 2] = 1.0
    table = np.array(
        rope(mx.broadcast_to(mx.array(basis), (n, 1, 1, dim)), offset=positions).reshape(n, dim)
    )
    norms = None
    if qk_norm:
        norms = (
            rng.standard_normal(dim).astype(np.float32),
            rng.standard_normal(dim).astype(np.float32),
            1e-6,
        )
    k_pool = np.zeros((kv_heads, pool_slots, dim), np.float32)
    v_pool = np.zeros((kv_heads, pool_slots, dim), np.float32)
    slots = np.array([9, 2, 40, 63, 10], dtype=np.int32)
    store = partial(
        native.rope_store,
        qkv,
        table,
        heads=heads,
        kv_heads=kv_heads,
        traditional=traditional,
        norms=norms,
        k_pool=k_pool,
        v_pool=v_pool,
    )
    queries = store(slots=slots)

    def rotated(x: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        arr = mx.array(x)
        if weight is not None:
            arr = mx.fast.rms_norm(arr, mx.array(weight), 1e-6)
        return np.array(rope(arr[:, :, None, :], offset=positions)[:, :, 0, :])

    q = qkv[:, : heads * dim].reshape(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(n, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].reshape(n, kv_heads, dim)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(queries, rotated(q, norms and norms[0]), **tol)
    np.testing.assert_allclose(
        k_pool[:, slots].transpose(1, 0, 2), rotated(k, norms and norms[1]), **tol
    )
    np.testing.assert_array_equal(v_pool[:, slots].transpose(1, 0, 2), v)
    untouched = np.setdiff1d(np.arange(pool_slots), slots)
    assert not k_pool[:, untouched].any() and not v_pool[:, untouched].any()
    with pytest.raises(native.KernelError, match="slots"):
        store(slots=np.array([0, 1, 2, 3, pool_slots], dtype=np.int32))


def test_a_forked_child_runs_products_on_workers_of_its_own() -> None:
    """The parent's workers do not exist in a forked child; it must not wait for them."""
    rng = _rng(8)
    weight = native.pack(rng.standard_normal((64, 256)).astype(np.float32))
    x = rng.standard_normal((16, 64)).astype(np.float32)
    expected = native.product(x, weight, threads=2)  # the parent's worker is running now
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a child waiting for a worker that is not there dies, not hangs
        same = np.array_equal(native.product(x, weight, threads=2), expected)
        os._exit(0 if same else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_pack_model_takes_float32_models_and_leaves_quantized_ones(
    tiny_model: Path, tiny_q4_model: Path
) -> None:
    loaded = load(tiny_model)
    packed = pack_model(loaded.model, loaded.spec)
    assert packed is not None and len(packed.layers) == loaded.spec.num_layers
    layer = packed.layers[0]
    spec = loaded.spec
    assert layer.qkv.n == (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    assert layer.gate_up.swiglu and not layer.down.swiglu
    assert packed.head.n == spec.vocab_size
    quantized = load(tiny_q4_model)
    assert pack_model(quantized.model, quantized.spec) is None
