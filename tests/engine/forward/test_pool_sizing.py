"""The KV pool's default size: a per-sequence token budget, between one and all
sequences at max_model_len, capped by memory, logged once with what bounded it."""

from __future__ import annotations

import logging
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import pytest

from batchd.engine.config import EngineConfig
from batchd.engine.forward.kv_pool import (
    MIN_BLOCKS,
    PoolBound,
    plan_pool,
    sequence_blocks,
    size_pool,
)
from batchd.engine.llm_engine import LLMEngine
from batchd.engine.models.loader import ModelSpec, load

# SmolLM2-135M as the daemon serves it (float32): 45 KiB of K/V per token.
SMOLLM2 = ModelSpec(
    model_type="llama",
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    dtype=mx.float32,
    qk_norm=False,
)
PLENTY = 1 << 40


def _plan(**options: object) -> object:
    args: dict[str, object] = {
        "block_size": 16,
        "max_num_seqs": 32,
        "max_model_len": 8192,
        "tokens_per_seq": EngineConfig.kv_tokens_per_seq,
        "memory_fraction": 0.5,
        "available_bytes": PLENTY,
    }
    args.update(options)
    return plan_pool(SMOLLM2, **args)  # type: ignore[arg-type]


def test_default_is_the_token_budget_not_half_of_memory() -> None:
    assert SMOLLM2.kv_bytes_per_token == 45 * 1024
    plan = plan_pool(
        SMOLLM2,
        block_size=16,
        max_num_seqs=32,
        max_model_len=8192,
        tokens_per_seq=1024,
        memory_fraction=0.5,
        available_bytes=22 << 30,  # the machine of the report: 11 GiB would have gone
    )
    assert (plan.blocks, plan.tokens, plan.bound) == (2048, 32768, PoolBound.BUDGET)
    assert plan.mib == 1440.0
    assert "max_num_seqs 32 x kv_tokens_per_seq 1024" in plan.why


def test_budget_rounds_up_to_whole_blocks() -> None:
    plan = _plan(max_num_seqs=3, tokens_per_seq=1000, max_model_len=100)
    assert plan.bound is PoolBound.ALL_SEQUENCES  # 3 x 100 tokens is all there can be
    plan = _plan(max_num_seqs=3, tokens_per_seq=1000, max_model_len=2000)
    assert plan.blocks == 3 * 63 and plan.bound is PoolBound.BUDGET


def test_at_least_one_sequence_at_max_model_len() -> None:
    plan = _plan(max_num_seqs=2, tokens_per_seq=256)
    assert plan.blocks == sequence_blocks(8192, 16) == 512
    assert plan.bound is PoolBound.ONE_SEQUENCE
    assert "one sequence at max_model_len 8192" in plan.why


def test_at_most_every_sequence_at_max_model_len() -> None:
    plan = _plan(max_num_seqs=4, tokens_per_seq=4096, max_model_len=1000)
    assert plan.blocks == 4 * sequence_blocks(1000, 16) == 4 * 63
    assert plan.bound is PoolBound.ALL_SEQUENCES


def test_memory_fraction_caps_whatever_was_wanted() -> None:
    block_bytes = SMOLLM2.kv_bytes_per_token * 16
    plan = _plan(available_bytes=1000 * block_bytes, memory_fraction=0.25)
    assert plan.blocks == 250 and plan.bound is PoolBound.MEMORY
    assert "kv_memory_fraction 0.25" in plan.why and "wanted 2048 blocks" in plan.why


def test_floor_of_min_blocks_and_explicit_size() -> None:
    plan = _plan(available_bytes=0)
    assert plan.blocks == MIN_BLOCKS and plan.bound is PoolBound.MINIMUM
    plan = _plan(num_blocks=7, available_bytes=None)  # set: memory is never asked
    assert plan.blocks == 7 and plan.bound is PoolBound.SET
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        _plan(memory_fraction=0.0)


def test_size_is_logged_once_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="batchd.engine.forward.kv_pool")
    blocks = size_pool(
        SMOLLM2,
        block_size=16,
        memory_fraction=0.5,
        max_num_seqs=32,
        max_model_len=8192,
        available_bytes=PLENTY,
    )
    assert blocks == 2048
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "KV pool: 2048 blocks of 16 tokens = 32768 tokens, 1440.0 MiB (float32 KV, "
        "46080 bytes a token); from max_num_seqs 32 x kv_tokens_per_seq 1024"
    )
    fields = {k: getattr(record, k) for k in ("event", "blocks", "tokens", "mib", "bound")}
    assert fields == {
        "event": "kv_pool",
        "blocks": 2048,
        "tokens": 32768,
        "mib": 1440.0,
        "bound": "budget",
    }


def test_a_pool_shorter_than_max_model_len_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="batchd.engine.forward.kv_pool")
    kwargs = {"block_size": 16, "memory_fraction": 0.5, "max_num_seqs": 4, "max_model_len": 8192}
    size_pool(SMOLLM2, num_blocks=512, **kwargs)  # type: ignore[arg-type]
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # 8192 tokens: enough
    caplog.clear()
    size_pool(SMOLLM2, num_blocks=511, **kwargs)  # type: ignore[arg-type]
    info, warning = caplog.records
    assert "num_kv_blocks = 511" in info.getMessage()
    assert warning.levelno == logging.WARNING
    assert "fewer than max_model_len 8192" in warning.getMessage()


def test_engine_sizes_its_pool_by_the_rule(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="batchd.engine.forward.kv_pool")
    loaded = load(tiny_model)
    config = EngineConfig(max_num_seqs=4, max_model_len=256, kv_tokens_per_seq=32)
    eng = LLMEngine(loaded, config)
    # 4 x 32 tokens = 8 blocks, raised to one 256-token sequence (16 blocks).
    assert eng.pool.num_blocks == eng.scheduler.block_manager.num_blocks == 16
    [record] = [r for r in caplog.records if r.name == "batchd.engine.forward.kv_pool"]
    assert record.bound == "one_sequence"  # type: ignore[attr-defined]
    caplog.clear()
    eng = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=40))
    assert eng.pool.num_blocks == 40
    [record] = [r for r in caplog.records if r.name == "batchd.engine.forward.kv_pool"]
    assert record.bound == "num_kv_blocks"  # type: ignore[attr-defined]
