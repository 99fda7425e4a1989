"""Greedy parity with mlx-lm's generate_step on a real model: SmolLM2 from its GGUF.

The same scenarios as test_parity (batch mixes, chunked prefill, prefix-cache
hits, preemption) on real shapes (30 layers, 9 query / 3 KV heads, a 49152
vocabulary, traditional rope), fewer and shorter requests since every
reference token costs a full forward on the CPU. The mixed-batch scenario
runs in CI; the others are slow.
"""

from __future__ import annotations

from pathlib import Path

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
from batchd.engine.models.loader import LoadedModel, load

VOCAB = 49152


@pytest.fixture(scope="module")
def smollm2(smollm2_model: Path) -> tuple[LoadedModel, Reference]:
    loaded = load(smollm2_model)
    return loaded, Reference(loaded.model)


def _engine(loaded: LoadedModel, **options: int | str) -> LLMEngine:
    config: dict[str, int | str] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "num_kv_blocks": 256,
    }
    config.update(options)
    return LLMEngine(loaded, EngineConfig(**config))  # type: ignore[arg-type]


# auto: the C kernels on an x86 CPU; mlx: the MLX path, sampling on the device.
@pytest.mark.parametrize("backend", ["auto", "mlx"])
def test_parity_mixed_batches(smollm2: tuple[LoadedModel, Reference], backend: str) -> None:
    loaded, ref = smollm2
    reqs = random_requests(8, seed=1, vocab=VOCAB, prompt_len=(1, 60), max_tokens=(1, 12))
    eng = _engine(loaded, forward_backend=backend)
    report = check_parity(ref, reqs, run_engine(eng, reqs, waves=2, gap=3))
    assert report.tokens > 40
    assert len(report.divergences) <= 1, report.divergences


@pytest.mark.slow
def test_parity_chunked_prefill(smollm2: tuple[LoadedModel, Reference]) -> None:
    loaded, ref = smollm2
    reqs = random_requests(12, seed=2, vocab=VOCAB, prompt_len=(20, 200), max_tokens=(1, 16))
    eng = _engine(loaded, max_num_seqs=6, max_num_batched_tokens=40)
    check_parity(ref, reqs, run_engine(eng, reqs, waves=2))


@pytest.mark.slow
def test_parity_with_prefix_cache_hits(smollm2: tuple[LoadedModel, Reference]) -> None:
    loaded, ref = smollm2
    reqs = shared_prefix_requests(12, seed=3, vocab=VOCAB)
    eng = _engine(loaded, max_num_batched_tokens=128)
    outputs = run_engine(eng, reqs, waves=4, gap=12)
    assert eng.last_step_stats.prefix_cache_hit_rate > 0.2
    check_parity(ref, reqs, outputs)


@pytest.mark.slow
def test_parity_under_preemption(smollm2: tuple[LoadedModel, Reference]) -> None:
    loaded, ref = smollm2
    reqs = random_requests(12, seed=4, vocab=VOCAB, prompt_len=(40, 160), max_tokens=(8, 24))
    # 24 blocks of 16 = 384 tokens for 8 running sequences of up to 184 tokens.
    eng = _engine(loaded, num_kv_blocks=24, max_num_batched_tokens=256)
    outputs = run_engine(eng, reqs)
    assert eng.last_step_stats.num_preemptions_total > 0
    check_parity(ref, reqs, outputs)
