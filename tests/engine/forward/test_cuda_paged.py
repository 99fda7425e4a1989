"""The CUDA paged decode kernel against a float64 reference, on random pools.

Each case draws a pool of random K/V blocks, block tables of shuffled block ids (so a
row's blocks are scattered through the pool, never in order) and lengths from 1 key to
several blocks, and checks every output element of the kernel against attention
computed in float64 with NumPy. Rows of a prefill chunk (one table, lengths start + i + 1)
are checked the same way. On a CUDA GPU the kernel runs through ``mx.fast.cuda_kernel``;
everywhere else the same source runs through the CPU emulation of
tests/engine/cuda_emulation, so its logic is checked in CI too (smaller cases: every
emulated thread is a host thread).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np
import pytest

from batchd.engine.forward import cuda_paged, step_plan
from batchd.engine.forward.backend import CUDA_PAGED, GATHER, choose
from batchd.engine.forward.cuda_paged import KernelShape

ON_CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()

# ‖out − ref‖ / ‖ref‖ bounds: float32 arithmetic throughout, inputs rounded to the dtype.
TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}
NUMPY = {mx.float32: np.float32, mx.float16: np.float16}


def _pool(rng: np.random.Generator, kv_heads: int, blocks: int, bs: int, dim: int) -> np.ndarray:
    return rng.standard_normal((kv_heads, blocks * bs, dim)).astype(np.float32)


def _tables(rng: np.random.Generator, lengths: list[int], blocks: int, bs: int) -> np.ndarray:
    width = -(-max(lengths) // bs)
    tables = np.zeros((len(lengths), width), dtype=np.int32)
    for r, length in enumerate(lengths):
        used = -(-length // bs)
        tables[r, :used] = rng.permutation(blocks)[:used]
    return tables


def reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    scale: float,
    bs: int,
) -> np.ndarray:
    """Attention in float64: q [R, H, D] over the keys each row's table names."""
    rows, heads, dim = q.shape
    group = heads // k.shape[0]
    out = np.zeros((rows, heads, dim))
    for r in range(rows):
        t = np.arange(lengths[r])
        slots = tables[r, t // bs].astype(np.int64) * bs + t % bs
        for h in range(heads):
            keys = k[h // group, slots].astype(np.float64)
            values = v[h // group, slots].astype(np.float64)
            scores = keys @ q[r, h].astype(np.float64) * scale
            weights = np.exp(scores - scores.max())
            out[r, h] = weights @ values / weights.sum()
    return out.reshape(rows, heads * dim)


def _rounded(x: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """``x`` as the kernel sees it: rounded to ``dtype``, back in float32."""
    return np.array(mx.array(x).astype(dtype).astype(mx.float32))


def _run(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    scale: float,
    bs: int,
    dtype: mx.Dtype,
) -> np.ndarray:
    arrays = [mx.array(a).astype(dtype) for a in (q, k, v)]
    if ON_CUDA:
        qd, kd, vd = arrays
        out = cuda_paged.paged_decode(
            qd,
            kd,
            vd,
            mx.array(tables),
            mx.array(lengths),
            mx.array([scale], dtype=mx.float32),
            block_size=bs,
        )
        return np.array(out.astype(mx.float32))
    return _emulated(arrays, tables, lengths, scale, bs)


def _emulated(
    arrays: list[mx.array], tables: np.ndarray, lengths: np.ndarray, scale: float, bs: int
) -> np.ndarray:
    """The kernel's source run by the CPU emulation, as MLX would build and launch it."""
    emulate = pytest.importorskip("tests.engine.cuda_emulation.emulate")
    spec = pytest.importorskip("tests.engine.cuda_emulation.spec")
    if not emulate.gxx_available():
        pytest.skip("the CUDA emulation needs g++")
    q, k, v = arrays
    grid, block, template = cuda_paged.launch(
        q, k, v, mx.array(tables), mx.array(lengths), block_size=bs
    )
    name = str(q.dtype).removeprefix("mlx.core.")
    kernel = spec.KernelSpec(
        name="batchd_paged_decode",
        inputs=tuple((n, name) for n in ("q", "k", "v"))
        + (("tables", "int32"), ("lengths", "int32"), ("scale", "float32")),
        outputs=(("out", name),),
        source=cuda_paged.SOURCE,
        header=cuda_paged.HEADER,
        template=tuple(template),
    )
    host = {
        n: np.array(a) if a.dtype == mx.float16 else np.array(a.astype(mx.float32))
        for n, a in zip("qkv", arrays, strict=True)
    }
    inputs = {**host, "tables": tables, "lengths": lengths}
    inputs["scale"] = np.array([scale], dtype=np.float32)
    (out,) = emulate.run_kernel(kernel, inputs, [q.shape], grid, block)
    return np.asarray(out, dtype=np.float32).reshape(q.shape[0], -1)


def _check(
    rng: np.random.Generator,
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    bs: int,
    lengths: list[int],
    dtype: mx.Dtype,
    tables: np.ndarray | None = None,
) -> None:
    blocks = max(8, 2 * sum(-(-n // bs) for n in lengths))
    k, v = _pool(rng, kv_heads, blocks, bs, dim), _pool(rng, kv_heads, blocks, bs, dim)
    q = rng.standard_normal((len(lengths), heads, dim)).astype(np.float32)
    if tables is None:
        tables = _tables(rng, lengths, blocks, bs)
    lengths_array = np.asarray(lengths, dtype=np.int32)
    scale = dim**-0.5
    out = _run(q, k, v, tables, lengths_array, scale, bs, dtype)
    ref = reference(
        _rounded(q, dtype),
        _rounded(k, dtype),
        _rounded(v, dtype),
        tables,
        lengths_array,
        scale,
        bs,
    )
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    error = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


# Every GQA ratio of 1, 2, 3, 4, 8 and 4:1 with one KV head, head dims 64/128 (256 as
# Gemma's), block sizes 16/32 and each dtype, over about one compilation each.
F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16
GPU_CASES = [
    (8, 8, 64, 16, F32),
    (8, 8, 128, 32, BF16),
    (8, 4, 64, 32, F16),
    (8, 4, 128, 16, BF16),
    (9, 3, 64, 16, BF16),
    (9, 3, 64, 32, F32),
    (32, 8, 128, 16, BF16),
    (32, 8, 128, 32, F32),
    (16, 2, 128, 16, F16),
    (16, 2, 64, 32, BF16),
    (32, 4, 128, 16, BF16),
    (4, 1, 256, 16, BF16),
]
CPU_CASES = [
    (4, 4, 64, 16, mx.float32),
    (6, 2, 64, 16, mx.bfloat16),
    (8, 2, 128, 32, mx.float32),
    (9, 3, 64, 32, mx.float16),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bs", "dtype"),
    GPU_CASES if ON_CUDA else CPU_CASES,
    ids=lambda x: str(x).removeprefix("mlx.core."),
)
def test_decode_rows_match_float64_attention(
    heads: int, kv_heads: int, dim: int, bs: int, dtype: mx.Dtype
) -> None:
    rng = np.random.default_rng(heads * 1000 + dim + bs)
    # One key, a block exactly, a block and one, several blocks, long rows on a GPU.
    lengths = [1, bs, bs + 1, 3 * bs - 5, 5]
    lengths += [2000, 517, 64] if ON_CUDA else [2 * bs + 3]
    _check(rng, heads=heads, kv_heads=kv_heads, dim=dim, bs=bs, lengths=lengths, dtype=dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_rows_of_a_prefill_chunk_match(dtype: mx.Dtype) -> None:
    """A chunk of n tokens from position ``start``: row i sees start + i + 1 keys."""
    rng = np.random.default_rng(7)
    bs, start, n = 16, 37, 12 if not ON_CUDA else 200
    lengths = [start + i + 1 for i in range(n)]
    blocks = 64
    table = rng.permutation(blocks)[: -(-(start + n) // bs)].astype(np.int32)
    tables = np.tile(table, (n, 1))
    _check(rng, heads=8, kv_heads=2, dim=64, bs=bs, lengths=lengths, dtype=dtype, tables=tables)


def test_shape_limits_are_named() -> None:
    assert KernelShape(32, 8, 128).problem() is None
    assert "multiple of 32" in str(KernelShape(8, 8, 80).problem())
    assert "evenly" in str(KernelShape(9, 2, 64).problem())
    assert "shared memory" in str(KernelShape(64, 1, 256).problem())


def test_the_choice_names_the_decode_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = KernelShape(32, 8, 128)
    choice = choose("mlx", dtype=mx.bfloat16, shape=shape)
    assert choice.attention == (CUDA_PAGED if ON_CUDA else GATHER)
    assert f"decode attention: {choice.attention}" in choice.describe()
    monkeypatch.setenv(cuda_paged.DISABLE_ENV, "0")
    off = choose("mlx", dtype=mx.bfloat16, shape=shape)
    assert off.attention == GATHER and cuda_paged.DISABLE_ENV in off.attention_reason
    assert choose("mlx", dtype=mx.bfloat16, quantized_kv=True, shape=shape).attention == GATHER
    assert choose("mlx", dtype=mx.bfloat16, generic=True, shape=shape).attention == GATHER


def test_a_step_plan_sends_decode_rows_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows become per-row tables and lengths; prefill chunks stay as they were;
    too few rows for the GPU (rows x KV heads under PAGED_MIN_BLOCKS) gather instead."""
    from batchd.engine.forward.step_plan import plan_step

    class Chunk:
        def __init__(self, tokens: list[int], start: int, table: list[int]) -> None:
            self.token_ids, self.start, self.block_table = tokens, start, table
            self.slots = [table[p // 4] * 4 + p % 4 for p in range(start, start + len(tokens))]
            self.samples = True

    chunks = [Chunk([5], 6, [3, 9]), Chunk([1, 2, 3], 0, [7]), Chunk([8], 12, [1, 2, 4, 6])]
    common: dict[str, Any] = dict(
        block_size=4, row_multiple=1, lanes=1, num_kv_heads=2, kernel=False
    )
    few = plan_step(chunks, None, packed=False, paged_decodes=True, **common)
    assert few.paged_decodes is None and few.decode_groups  # 2 rows x 2 KV heads < 64
    monkeypatch.setattr(step_plan, "PAGED_MIN_BLOCKS", 4)
    plan = plan_step(chunks, None, packed=False, paged_decodes=True, **common)
    assert plan.paged_decodes is not None and plan.decode_groups == []
    assert plan.paged_decodes.count == 2
    # Longest first: the chunk at position 12 (13 keys, 4 blocks), then 7 keys (2 blocks).
    assert np.array(plan.paged_decodes.lengths).tolist() == [13, 7]
    assert np.array(plan.paged_decodes.tables).tolist() == [[1, 2, 4, 6], [3, 9, 0, 0]]
    assert [(p.row_start, p.row_end, p.start) for p in plan.prefills] == [(2, 5, 0)]
    gathered = plan_step(chunks, None, packed=False, **common)
    assert gathered.paged_decodes is None and gathered.decode_groups
    prompts_only = plan_step(chunks[1:2], None, packed=False, paged_decodes=True, **common)
    assert prompts_only.paged_decodes is None and prompts_only.decode_groups == []


def _reference_kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    tables: mx.array,
    lengths: mx.array,
    scale: mx.array,
    *,
    block_size: int,
) -> mx.array:
    """The kernel's contract computed by the float64 reference (for the runner's wiring)."""
    qf, kf, vf = (np.array(a.astype(mx.float32)) for a in (q, k, v))
    scale_value = float(np.array(scale)[0])
    out = reference(qf, kf, vf, np.array(tables), np.array(lengths), scale_value, block_size)
    return mx.array(out.astype(np.float32)).astype(q.dtype)


def test_the_engine_sends_every_decode_row_through_the_kernel(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's wiring, on any device: with the kernel's contract computed by the
    reference, greedy outputs still match mlx-lm request by request, and every step
    with decode rows called it once per layer with exactly those rows."""
    from parity_harness import Reference, check_parity, random_requests, run_engine

    from batchd.engine import EngineConfig, LLMEngine
    from batchd.engine.models.loader import load

    calls: list[int] = []

    def counted(q: mx.array, *args: object, **kwargs: object) -> mx.array:
        calls.append(q.shape[0])
        return _reference_kernel(q, *args, **kwargs)  # type: ignore[arg-type]

    if not ON_CUDA:
        monkeypatch.setattr(cuda_paged, "problem", lambda *a, **k: None)
        monkeypatch.setattr(cuda_paged, "paged_decode", counted)
    # The tiny model's few rows would gather below the production bound.
    monkeypatch.setattr(step_plan, "PAGED_MIN_BLOCKS", 1)
    loaded = load(tiny_model)
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256, forward_backend="mlx"
    )
    engine = LLMEngine(loaded, config)
    assert engine.backend.attention == CUDA_PAGED
    calls.clear()  # the start-up check's call
    reqs = random_requests(10, seed=3, vocab=1024, prompt_len=(1, 80), max_tokens=(1, 24))
    report = check_parity(Reference(loaded.model), reqs, run_engine(engine, reqs, waves=3))
    assert report.tokens > 100
    assert len(report.divergences) <= 1, report.divergences
    if not ON_CUDA:
        layers = len(loaded.model.layers)
        assert calls and len(calls) % layers == 0
        assert max(calls) > 1  # several decode rows in one call


def _kernel_that_raises(*args: object, **kwargs: object) -> mx.array:
    raise RuntimeError("Failed to compile kernel: cuda_bf16.h: No such file")


def _kernel_off_by_a_tenth(*args: Any, **kwargs: Any) -> mx.array:
    return _reference_kernel(*args, **kwargs) * 1.1


@pytest.mark.parametrize(
    ("kernel", "named"),
    [(_kernel_that_raises, "cuda_bf16.h"), (_kernel_off_by_a_tenth, "differs")],
    ids=["fails-to-build", "wrong"],
)
def test_a_kernel_that_fails_its_start_up_check_leaves_the_gather_path(
    kernel: Any, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The choice runs the kernel once before trusting it: a kernel that cannot build
    (say, CUDA's headers missing) or disagrees with the gather path is named, and decode
    attention gathers instead of failing the first step."""
    monkeypatch.setattr(cuda_paged, "problem", lambda *a, **k: None)
    monkeypatch.setattr(cuda_paged, "paged_decode", kernel)
    choice = choose("mlx", dtype=mx.bfloat16, shape=KernelShape(8, 2, 64))
    assert choice.attention == GATHER
    assert "start-up check" in choice.attention_reason and named in choice.attention_reason
    monkeypatch.setattr(cuda_paged, "paged_decode", _reference_kernel)
    trusted = choose("mlx", dtype=mx.bfloat16, shape=KernelShape(8, 2, 64))
    assert trusted.attention == CUDA_PAGED


def test_doctor_names_the_kernel_before_any_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no model yet (batchd doctor), a CUDA machine is told the kernel's conditions,
    not "gather"; no kernel is built for that."""
    monkeypatch.setattr(cuda_paged, "paged_decode", _kernel_that_raises)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    choice = choose("mlx", dtype=None)
    assert choice.attention == CUDA_PAGED and "start-up check" in choice.attention_reason
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert choose("mlx", dtype=None).attention == GATHER
