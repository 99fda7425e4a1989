"""Greedy float32 parity with mlx-lm's generate_step, request by request, in every batch shape.

Each scenario runs 32 requests (prompts 1-300 tokens, max_tokens 1-64)
through one engine and compares every request with the same request run alone
by mlx-lm (see parity_harness for the near-tie rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import (
    Reference,
    check_parity,
    random_requests,
    run_engine,
    shared_prefix_requests,
)

from batchd.engine import EngineConfig, LLMEngine
from batchd.engine.forward import fast_math, prefill_buckets
from batchd.engine.forward.model_runner import ModelRunner
from batchd.engine.forward.step_plan import StepPlan
from batchd.engine.models.loader import LoadedModel, load

VOCAB = 1024


@pytest.fixture(scope="module")
def llama(tiny_model: Path) -> tuple[LoadedModel, Reference]:
    loaded = load(tiny_model)
    return loaded, Reference(loaded.model)


@pytest.fixture(scope="module")
def qwen3(qwen3_model: Path) -> tuple[LoadedModel, Reference]:
    loaded = load(qwen3_model)
    return loaded, Reference(loaded.model)


def _engine(loaded: LoadedModel, **options: int | str) -> LLMEngine:
    config: dict[str, int | str] = {
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 512,
    }
    config.update(options)
    return LLMEngine(loaded, EngineConfig(**config))  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("waves", [1, 4], ids=["together", "staggered"])
# auto: the C kernels on an x86 CPU; mlx: the MLX path (BATCHD_NATIVE_ATTENTION=0's),
# sampling on the device.
@pytest.mark.parametrize("backend", ["auto", "mlx"])
def test_parity_mixed_batches(
    arch: str, waves: int, backend: str, request: pytest.FixtureRequest
) -> None:
    loaded, ref = request.getfixturevalue(arch)
    reqs = random_requests(32, seed=1, vocab=VOCAB)
    eng = _engine(loaded, forward_backend=backend)
    report = check_parity(ref, reqs, run_engine(eng, reqs, waves=waves))
    assert report.tokens > 500
    assert len(report.divergences) <= 1, report.divergences


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parity_chunked_prefill(arch: str, request: pytest.FixtureRequest) -> None:
    loaded, ref = request.getfixturevalue(arch)
    reqs = random_requests(32, seed=1, vocab=VOCAB)
    eng = _engine(loaded, max_num_seqs=8, max_num_batched_tokens=40)
    chunked = 0
    outputs: list[list[int]] = []

    original_step = eng.step

    def counting_step() -> list:  # type: ignore[type-arg]
        nonlocal chunked
        result = original_step()
        stats = eng.last_step_stats
        chunked += sum(
            1 for c in stats.chunks if c.kind == "prefill" and c.start > 0 and c.num_tokens > 1
        )
        return result

    eng.step = counting_step  # type: ignore[method-assign]
    outputs = run_engine(eng, reqs, waves=2)
    assert chunked > 10, "prompts should have been split across steps"
    check_parity(ref, reqs, outputs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
# mlx-sdpa: MLX's own attention kernel, as a GPU runs it; fast-math: the CPU's products.
@pytest.mark.parametrize("exact", [True, False], ids=["mlx-sdpa", "fast-math"])
def test_parity_chunked_prefill_bucketed(
    arch: str, exact: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks padded to bucketed shapes (as on a CUDA GPU: prefill_buckets), fresh
    prompts and chunks over a cached prefix alike, change no request's tokens."""
    monkeypatch.setenv(prefill_buckets.ENV, "1")
    if exact:
        monkeypatch.setenv(fast_math.DISABLE_ENV, "1")
    loaded, ref = request.getfixturevalue(arch)
    reqs = random_requests(32, seed=1, vocab=VOCAB)
    eng = _engine(loaded, forward_backend="mlx", max_num_seqs=8, max_num_batched_tokens=40)
    assert isinstance(eng.runner, ModelRunner) and eng.runner.bucket_prefill
    padded: list[tuple[int, int, bool]] = []  # (tokens, rows attended, over a prefix)
    plan = eng.runner._plan

    def recording_plan(*args: Any) -> StepPlan:
        made = plan(*args)
        padded.extend((p.row_end - p.row_start, p.rows, p.start > 0) for p in made.prefills)
        return made

    eng.runner._plan = recording_plan  # type: ignore[method-assign]
    check_parity(ref, reqs, run_engine(eng, reqs, waves=2))
    assert any(rows > tokens and prefix for tokens, rows, prefix in padded), padded
    assert any(rows > tokens and not prefix for tokens, rows, prefix in padded), padded
    assert all(rows & (rows - 1) == 0 for _, rows, _ in padded), padded


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parity_with_a_prefill_bound_filling_the_row_tile(
    arch: str, request: pytest.FixtureRequest
) -> None:
    loaded, ref = request.getfixturevalue(arch)
    reqs = random_requests(24, seed=4, vocab=VOCAB)
    eng = _engine(loaded, max_prefill_tokens_with_decodes=2)
    mixes: set[tuple[int, int]] = set()
    original_step = eng.step

    def recording_step() -> list:  # type: ignore[type-arg]
        result = original_step()
        stats = eng.last_step_stats
        if stats.num_decode_tokens and stats.num_prefill_tokens:
            mixes.add((stats.num_decode_tokens, stats.num_prefill_tokens))
        return result

    eng.step = recording_step  # type: ignore[method-assign]
    outputs = run_engine(eng, reqs, waves=6, gap=3)
    rows = eng.runner.computed_rows
    assert eng.scheduler.computed_rows == rows
    if rows(3) > 3:  # rows beyond the bound of 2 went into steps with decodes
        assert any(prefill > 2 for _, prefill in mixes), mixes
    assert all(p <= max(2, rows(d + 2) - d) for d, p in mixes), mixes
    check_parity(ref, reqs, outputs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parity_with_prefix_cache_hits(arch: str, request: pytest.FixtureRequest) -> None:
    loaded, ref = request.getfixturevalue(arch)
    reqs = shared_prefix_requests(32, seed=2, vocab=VOCAB)
    eng = _engine(loaded, max_num_batched_tokens=128)
    outputs = run_engine(eng, reqs, waves=4, gap=12)
    assert eng.last_step_stats.prefix_cache_hit_rate > 0.2
    check_parity(ref, reqs, outputs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parity_under_preemption(arch: str, request: pytest.FixtureRequest) -> None:
    loaded, ref = request.getfixturevalue(arch)
    reqs = random_requests(32, seed=1, vocab=VOCAB)
    # 40 blocks of 16 = 640 tokens for 16 running sequences of up to 364 tokens.
    eng = _engine(loaded, num_kv_blocks=40, max_num_batched_tokens=256)
    preempted: set[str] = set()
    original_step = eng.step

    def recording_step() -> list:  # type: ignore[type-arg]
        result = original_step()
        preempted.update(eng.last_step_stats.preempted)
        return result

    eng.step = recording_step  # type: ignore[method-assign]
    outputs = run_engine(eng, reqs)
    assert eng.last_step_stats.num_preemptions_total > 0 and preempted
    check_parity(ref, reqs, outputs)


def test_parity_quantized_4bit(tiny_q4_model: Path) -> None:
    loaded = load(tiny_q4_model)
    ref = Reference(loaded.model)
    reqs = random_requests(32, seed=3, vocab=VOCAB)
    report = check_parity(ref, reqs, run_engine(_engine(loaded), reqs, waves=2))
    assert len(report.divergences) <= 2, report.divergences
