"""The C decode-attention kernel against MLX's gather path, its argument checks, and the
engine on both paths (the gather path stays tested where the kernel is on)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np
import pytest

from batchd.engine import EngineConfig, LLMEngine
from batchd.engine.forward import native
from batchd.engine.forward.paged_attention import decode_attention, make_decode_group
from batchd.engine.models.loader import load
from tests.engine.parity_harness import Reference, check_parity, random_requests, run_engine

BLOCK = 16


def _case(
    lengths: list[int], *, heads: int, kv_heads: int, dim: int = 32, blocks: int = 96, seed: int = 0
) -> tuple[mx.array, mx.array, mx.array, list[list[int]]]:
    rng = np.random.default_rng(seed)
    shape = (kv_heads, blocks * BLOCK, dim)
    k = mx.array(rng.standard_normal(shape).astype(np.float32))
    v = mx.array(rng.standard_normal(shape).astype(np.float32))
    q = mx.array(rng.standard_normal((len(lengths), heads, dim)).astype(np.float32))
    # Each sequence's blocks are scattered over the pool, not consecutive.
    order = rng.permutation(blocks).tolist()
    tables = []
    for length in lengths:
        used = -(-length // BLOCK)
        tables.append(order[:used])
        order = order[used:]
    mx.eval(k, v, q)
    return q, k, v, tables


def _kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    tables: list[list[int]],
    lengths: list[int],
    *,
    threads: int = 2,
) -> np.ndarray:
    width = max(len(t) for t in tables)
    padded = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return native.paged_decode(
        np.asarray(q),
        np.asarray(k),
        np.asarray(v),
        padded,
        np.asarray(lengths, dtype=np.int32),
        block_size=BLOCK,
        scale=0.17,
        threads=threads,
    )


needs_kernel = pytest.mark.skipif(
    not native.available(), reason="no C compiler here: the kernel cannot be built"
)


def test_the_kernel_builds_wherever_there_is_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source that does not compile must fail here, not turn the kernel tests into skips
    (the engine would quietly run the slower MLX path)."""
    compiler = native.compiler()
    if compiler is None:
        pytest.skip("no C compiler here: the kernel cannot be built")
    monkeypatch.setenv("BATCHD_HOME", str(tmp_path))  # a build of its own, not a cached one
    try:
        built = native._build(compiler)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the kernel does not compile: {exc.stderr.decode(errors='replace')}")
    assert built.is_file() and built.parent == tmp_path / "kernels"


@needs_kernel
@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads"),
    [
        ([300, 257, 256, 255, 40, 17, 16, 1], 9, 3),  # block edges, a lone first token
        ([1], 4, 4),  # no grouping
        ([500, 3], 8, 1),  # every query head on one KV head
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 5])
# 32, 64, 128: the vector path's specialised head sizes; 48 its general one; 40 the plain loops.
@pytest.mark.parametrize("dim", [32, 64, 128, 48, 40])
def test_kernel_matches_the_gather_path(
    lengths: list[int], heads: int, kv_heads: int, threads: int, dim: int
) -> None:
    q, k, v, tables = _case(lengths, heads=heads, kv_heads=kv_heads, dim=dim)
    group = make_decode_group(0, tables, lengths, block_size=BLOCK, num_kv_heads=kv_heads)
    blocked = (kv_heads, k.shape[1] // BLOCK, BLOCK, k.shape[2])
    expected = np.array(
        decode_attention(q, k.reshape(blocked), v.reshape(blocked), group, scale=0.17)
    )
    got = _kernel(q, k, v, tables, lengths, threads=threads).reshape(len(lengths), -1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_refuses_what_would_read_outside_the_pool() -> None:
    q, k, v, tables = _case([40, 20], heads=4, kv_heads=2)
    with pytest.raises(native.KernelError, match="block ids"):
        _kernel(q, k, v, [[0, 1, 96], [2, 3]], [40, 20])
    with pytest.raises(native.KernelError, match="failed"):
        _kernel(q, k, v, tables, [49, 20])  # 49 keys need a fourth block of 16
    with pytest.raises(native.KernelError, match="float32"):
        _kernel(q.astype(mx.float16), k, v, tables, [40, 20])


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> tuple[object, Reference]:
    loaded = load(tiny_model)
    return loaded, Reference(loaded.model)


@pytest.mark.parametrize("path", ["packed", "kernel", "mlx"])
def test_engine_matches_mlx_lm_on_each_cpu_path(
    path: str, reference: tuple[object, Reference], monkeypatch: pytest.MonkeyPatch
) -> None:
    """packed: every layer piece in C (the default); kernel: C attention and SwiGLU with
    OpenBLAS's products (BATCHD_NATIVE_PRODUCTS=0); mlx: MLX alone."""
    if path != "mlx" and not native.available():
        pytest.skip("no C compiler here: the kernels cannot be built")
    monkeypatch.setenv(native.DISABLE_ENV, "0" if path == "mlx" else "1")
    monkeypatch.setenv(native.PRODUCTS_DISABLE_ENV, "1" if path == "packed" else "0")
    loaded, ref = reference
    eng = LLMEngine(loaded, EngineConfig(max_num_seqs=16, num_kv_blocks=512))  # type: ignore[arg-type]
    assert eng.runner.native_attention is (path != "mlx")
    assert (eng.runner._packed is not None) is (path == "packed")
    reqs = random_requests(16, seed=3, vocab=1024)
    report = check_parity(ref, reqs, run_engine(eng, reqs, waves=2))
    assert report.tokens > 200
    assert len(report.divergences) <= 1, report.divergences


def test_without_a_compiler_the_kernels_say_why_and_what_it_costs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "compiler", lambda: None)
    native._build_once.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert native._library() is None
            native._library()  # asked again: said once
        assert "no C compiler" in native.describe() and "half" in native.describe()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "apt-get install gcc" in warnings[0].getMessage()
    finally:
        native._build_once.cache_clear()
