"""A model whose every layer attends within a sliding window gives back the blocks its
sequences' windows have passed, and stays greedy-equal to mlx-lm: prompts and generations
longer than the window, in mixed batches, with chunked prefill and prefix-cache hits.

The model is mlx-lm's exaone_moe with both layers sliding (arch_fixture); a model with a
full-attention layer (olmo3's fixture) keeps every block.
"""

from __future__ import annotations

import random

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from parity_harness import Reference, Req, check_parity, run_engine, watch_steps

from batchd.engine import EngineConfig, LLMEngine
from batchd.engine.models.arch_fixture import VOCAB, WINDOW, make_arch_model
from batchd.engine.models.loader import LoadedModel, load


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load(make_arch_model(tmp_path_factory.mktemp("arch") / "exaone_moe", "exaone_moe"))


def _requests(seed: int) -> list[Req]:
    """Six requests on one shared prefix, then six unrelated ones; most prompts and
    generations are longer than the window."""
    rng = random.Random(seed)
    head = [rng.randrange(4, VOCAB) for _ in range(50)]
    shared = [
        Req(tuple(head + [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 12))]), 40)
        for _ in range(6)
    ]
    other = [
        Req(tuple(rng.randrange(4, VOCAB) for _ in range(rng.randint(20, 80))), rng.randint(8, 48))
        for _ in range(6)
    ]
    return shared + other


def test_window_is_read_from_every_layers_cache(
    windowed: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert windowed.spec.kv_window == WINDOW
    mixed = load(make_arch_model(tmp_path_factory.mktemp("arch") / "olmo3", "olmo3"))
    assert mixed.spec.kv_window is None


def test_windowed_parity_with_released_blocks(windowed: LoadedModel) -> None:
    reqs = _requests(seed=3)
    assert sum(len(r.prompt) > WINDOW for r in reqs) >= 8
    assert sum(r.max_tokens > WINDOW for r in reqs) >= 6
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=40, num_kv_blocks=40, block_size=8)
    eng = LLMEngine(windowed, config)
    bm = eng.scheduler.block_manager
    watch = watch_steps(eng, after_step=bm.check_invariants)
    outputs = run_engine(eng, reqs, waves=3, gap=4)
    report = check_parity(Reference(windowed.model), reqs, outputs)
    assert not report.divergences, report.divergences
    assert watch.chunked > 0
    assert eng.last_step_stats.prefix_cache_hit_rate > 0
    assert bm.num_window_releases > 0
    assert bm.num_free_blocks == config.num_kv_blocks
