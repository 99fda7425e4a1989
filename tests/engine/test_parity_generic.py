"""Greedy float32 parity with mlx-lm for the architectures the generic path runs.

Each architecture is a tiny random-weight model built from mlx-lm's own classes
(batchd.engine.models.arch_fixture). One scenario per architecture mixes everything a
batch can hold: requests arriving in waves, prompts chunked across steps, shared
prefixes (prefix-cache hits) and a pool small enough to preempt; the prompts are longer
than the sliding window of the models that have one.
"""

from __future__ import annotations

import random

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import (
    Reference,
    Req,
    check_parity,
    random_requests,
    run_engine,
    watch_steps,
)

from batchd.engine import EngineConfig, LLMEngine
from batchd.engine.models.arch_fixture import ARCH_CONFIGS, VOCAB, WINDOW, make_arch_model
from batchd.engine.models.loader import load

ARCHES = sorted(ARCH_CONFIGS)


def _requests(seed: int) -> list[Req]:
    """Eight requests on two shared prefixes, then eight unrelated ones."""
    rng = random.Random(seed)
    heads = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(40, 90))] for _ in range(2)]
    shared = [
        Req(
            tuple(heads[i % 2] + [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 20))]),
            rng.randint(1, 24),
        )
        for i in range(8)
    ]
    return shared + random_requests(
        8, seed=seed, vocab=VOCAB, prompt_len=(1, 120), max_tokens=(1, 24)
    )


@pytest.mark.parametrize("arch", ARCHES)
def test_generic_parity_mixed_chunked_prefix_preempted(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    loaded = load(make_arch_model(tmp_path_factory.mktemp("arch") / arch, arch))
    assert loaded.spec.generic
    reqs = _requests(seed=7)
    assert max(len(r.prompt) for r in reqs) > WINDOW
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=48,
        num_kv_blocks=20,
        block_size=16,
        max_model_len=256,
    )
    eng = LLMEngine(loaded, config)
    watch = watch_steps(eng)
    outputs = run_engine(eng, reqs, waves=4, gap=3)
    stats = eng.last_step_stats
    report = check_parity(Reference(loaded.model), reqs, outputs)
    assert len(report.divergences) <= 1, report.divergences
    assert watch.chunked > 0
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hit_rate > 0
