"""Phi-3 128k / Phi-4-mini's long rope (``rope_scaling`` type ``longrope`` or ``su``): the
generic path runs mlx-lm's phi3 with its SuScaledRoPE (the long factors and the attention
scale at every position, as mlx-lm applies them), greedy-equal to mlx-lm for prompts and
generations that cross original_max_position_embeddings, in mixed batches with chunked
prefill and prefix hits."""

from __future__ import annotations

import random

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import Reference, Req, check_parity, run_engine

from batchd.engine import EngineConfig, LLMEngine
from batchd.engine.models.arch_fixture import VOCAB, make_arch_model
from batchd.engine.models.loader import load

ORIGINAL = 64
_LONG = [1.0, 1.2, 1.6, 2.4, 3.5, 5.0, 8.0, 12.0]  # one per rotated frequency (head_dim 16)


@pytest.mark.parametrize("kind", ["longrope", "su"])
def test_phi3_long_rope_parity_across_the_original_context(
    kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    overrides = {
        "max_position_embeddings": 16 * ORIGINAL,
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": {
            "type": kind,
            "short_factor": [1.0] * 8,
            "long_factor": _LONG,
            # transformers (the tokenizer's config check) wants it here for "su"
            "original_max_position_embeddings": ORIGINAL,
        },
    }
    path = make_arch_model(tmp_path_factory.mktemp("phi3") / kind, "phi3", overrides=overrides)
    loaded = load(path)
    rope = loaded.model.layers[0].self_attn.rope
    assert type(rope).__name__ == "SuScaledRoPE" and loaded.spec.generic
    rng = random.Random(5)
    head = [rng.randrange(4, VOCAB) for _ in range(ORIGINAL - 8)]
    reqs = [
        Req(tuple(head + [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 30))]), 24)
        for _ in range(4)
    ] + [
        Req(tuple(rng.randrange(4, VOCAB) for _ in range(rng.randint(5, 140))), 20)
        for _ in range(4)
    ]
    assert all(len(r.prompt) + r.max_tokens > ORIGINAL for r in reqs[:4])
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=48, block_size=16)
    eng = LLMEngine(loaded, config)
    outputs = run_engine(eng, reqs, waves=2, gap=3)
    report = check_parity(Reference(loaded.model), reqs, outputs)
    assert not report.divergences, report.divergences
    assert eng.last_step_stats.prefix_cache_hit_rate > 0
