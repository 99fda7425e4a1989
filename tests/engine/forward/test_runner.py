"""Model runner on hand-built packed batches: logits equal mlx-lm's full forward.

Also the pieces under it: the fast CPU exp, the loader's architecture check
and the pool sizing rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchd.engine.exceptions import UnsupportedModelError
from batchd.engine.forward import fast_math, native
from batchd.engine.forward.kv_pool import KVPool, size_pool
from batchd.engine.forward.model_runner import ROW_MULTIPLE, ModelRunner, padded_rows
from batchd.engine.forward.paged_attention import group_decodes, split_for_lanes
from batchd.engine.models.loader import LoadedModel, check_config, load, runs_fast
from batchd.engine.models.weight_layout import lay_out_for_cpu

BLOCK = 16


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


def _runner(loaded: LoadedModel, *, lanes: int | None = None) -> ModelRunner:
    pool = KVPool(loaded.spec, num_blocks=64, block_size=BLOCK)
    return ModelRunner(loaded.model, loaded.spec, pool, lanes=lanes)


@dataclass(frozen=True)
class Chunk:
    """A hand-built chunk (the runner's ChunkInput protocol)."""

    token_ids: list[int]
    start: int
    slots: list[int]
    block_table: list[int]
    samples: bool


def _chunk(tokens: list[int], start: int, n: int, table: list[int], samples: bool) -> Chunk:
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
    return Chunk(tokens[start : start + n], start, slots, table, samples)


def _reference_logits(loaded: LoadedModel, tokens: list[int]) -> np.ndarray:
    """mlx-lm's last-position logits for the whole sequence in one forward."""
    return np.array(loaded.model(mx.array(tokens)[None])[0, -1])


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 1000, n).tolist()


def test_packed_runner_matches_mlx_lm_with_biases_and_a_traditional_rope(
    tiny_model: Path,
) -> None:
    """Every bias the packing carries (q/k/v, o, gate/up, down) and RoPE over pairs
    (2i, 2i + 1), as GGUF imports rotate: the packed forward's logits equal mlx-lm's."""
    model = load(tiny_model)  # its own copy: the biases and rope change it
    rng = np.random.default_rng(21)
    for layer in model.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        for linear in (*projections, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            linear.bias = mx.array(rng.standard_normal(linear.weight.shape[0]).astype(np.float32))
        attn.rope = nn.RoPE(model.spec.head_dim, traditional=True, base=10000.0)
    runner = _runner(model)
    assert runner._packed is not None and runner._packed.rope_traditional
    tokens = rng.integers(4, 1000, 21).tolist()
    logits = runner.execute([_chunk(tokens, 0, len(tokens), [0, 1], True)])
    assert isinstance(logits, mx.array)  # the forward contract, whichever backend
    np.testing.assert_allclose(
        np.asarray(logits)[0], _reference_logits(model, tokens), rtol=1e-4, atol=2e-4
    )


def test_packed_batch_matches_full_forward(loaded: LoadedModel) -> None:
    runner = _runner(loaded)
    a, b, c = _tokens(0, 40), _tokens(1, 23), _tokens(2, 7)
    ta, tb, tc = [0, 1, 2], [3, 4], [5]
    # Step 1: a's first 30 tokens (no sampling), b whole, c's first 6.
    first = runner.execute(
        [_chunk(a, 0, 30, ta, False), _chunk(b, 0, 23, tb, True), _chunk(c, 0, 6, tc, False)]
    )
    assert first is not None and first.shape == (1, loaded.spec.vocab_size)
    np.testing.assert_allclose(np.array(first[0]), _reference_logits(loaded, b), atol=2e-4)
    # Step 2: c decodes its last token, a finishes its prompt from position 30, chunk order mixed.
    second = runner.execute([_chunk(a, 30, 10, ta, True), _chunk(c, 6, 1, tc, True)])
    assert second is not None
    np.testing.assert_allclose(np.array(second[0]), _reference_logits(loaded, a), atol=2e-4)
    np.testing.assert_allclose(np.array(second[1]), _reference_logits(loaded, c), atol=2e-4)


def test_decodes_of_different_lengths_batch_together(loaded: LoadedModel) -> None:
    runner = _runner(loaded)
    seqs = [_tokens(10 + i, n) for i, n in enumerate((5, 70, 33, 2))]
    tables = [[5 * i + j for j in range(5)] for i in range(len(seqs))]
    prefill = [_chunk(s, 0, len(s) - 1, t, False) for s, t in zip(seqs, tables, strict=True)]
    assert runner.execute(prefill) is None  # nothing samples: the pool is still written
    decodes = [_chunk(s, len(s) - 1, 1, t, True) for s, t in zip(seqs, tables, strict=True)]
    logits = runner.execute(decodes)
    assert logits is not None
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(np.array(logits[i]), _reference_logits(loaded, s), atol=2e-4)


def test_padding_rows_touch_no_pool_slot(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5 real tokens run as 16 rows on CPU with OpenBLAS's products (the packed products
    need no padding); only the 5 real slots of the pool are written."""
    assert [padded_rows(n, 16) for n in (1, 3, 4, 5, 16, 17, 500)] == [1, 3, 16, 16, 16, 32, 512]
    assert padded_rows(5, 1) == 5
    monkeypatch.setenv(native.PRODUCTS_DISABLE_ENV, "0")
    runner = _runner(loaded)
    assert runner._row_multiple == ROW_MULTIPLE  # tests run on the CPU
    seq = _tokens(50, 5)
    logits = runner.execute([_chunk(seq, 0, 5, [9], True)])
    assert logits is not None
    np.testing.assert_allclose(np.array(logits[0]), _reference_logits(loaded, seq), atol=2e-4)
    for layer in range(loaded.spec.num_layers):
        for pool in (runner.pool.k[layer], runner.pool.v[layer]):
            written = np.abs(np.array(pool)).sum(axis=(0, 2)) > 0
            assert np.flatnonzero(written).tolist() == list(range(9 * BLOCK, 9 * BLOCK + 5))
    # Five decodes already in packed order: the output projection's padding rows are dropped.
    seqs = [_tokens(60 + i, n) for i, n in enumerate((40, 30, 20, 10, 6))]
    tables = [[10 + 3 * i, 11 + 3 * i, 12 + 3 * i] for i in range(5)]
    runner.execute([_chunk(s, 0, len(s) - 1, t, False) for s, t in zip(seqs, tables, strict=True)])
    logits = runner.execute(
        [_chunk(s, len(s) - 1, 1, t, True) for s, t in zip(seqs, tables, strict=True)]
    )
    assert logits is not None and logits.shape == (5, loaded.spec.vocab_size)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(np.array(logits[i]), _reference_logits(loaded, s), atol=2e-4)


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_decode_lanes_give_the_same_logits(loaded: LoadedModel, lanes: int) -> None:
    """Decode groups cut into lanes on separate streams: same logits as mlx-lm, any lane count."""
    runner = _runner(loaded, lanes=lanes)
    seqs = [_tokens(20 + i, n) for i, n in enumerate((90, 88, 60, 41, 40, 9, 3))]
    tables = [[7 * i + j for j in range(7)] for i in range(len(seqs))]
    runner.execute([_chunk(s, 0, len(s) - 1, t, False) for s, t in zip(seqs, tables, strict=True)])
    step = [_chunk(s, len(s) - 1, 1, t, True) for s, t in zip(seqs, tables, strict=True)]
    # A prefill chunk rides along: decode lanes and prefill attention in one forward.
    extra = _tokens(30, 20)
    step.append(_chunk(extra, 0, 20, [60, 61], True))
    logits = runner.execute(step)
    assert logits is not None
    for i, s in enumerate([*seqs, extra]):
        np.testing.assert_allclose(np.array(logits[i]), _reference_logits(loaded, s), atol=2e-4)


@pytest.mark.parametrize(
    "lengths",
    [[90, 88, 60, 41, 40, 9, 3], [500], [7, 7], [300, 290, 280, 100, 90, 5, 4, 3, 2, 1], []],
)
@pytest.mark.parametrize("lanes", [1, 2, 3, 4])
def test_lane_pieces_cover_each_group_in_order(lengths: list[int], lanes: int) -> None:
    groups = group_decodes(lengths)
    pieces = split_for_lanes(lengths, groups, lanes)
    for start, end in groups:
        mine = [p for p in pieces if start <= p[0] < end]
        # Contiguous, non-empty runs that exactly cover the group, as many as rows and lanes allow.
        assert [p[0] for p in mine] == [start] + [p[1] for p in mine[:-1]]
        assert mine[-1][1] == end and all(a < b for a, b, _ in mine)
        assert len(mine) == min(lanes, end - start)
        assert len({lane for _, _, lane in mine}) == len(mine)
        assert all(0 <= lane < lanes for _, _, lane in mine)
    assert sum(b - a for a, b, _ in pieces) == len(lengths)
    if lanes == 2 and lengths == [300, 290, 280, 100, 90, 5, 4, 3, 2, 1]:
        # Cut by key length, not by row count: the longest rows make half the work.
        first = next(p for p in pieces if p[0] == 0)
        assert first[1] == 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cpu_weight_layout_changes_no_result(
    arch: str, tiny_model: Path, qwen3_model: Path
) -> None:
    """Weights re-laid for CPU BLAS: same shapes, and mlx-lm's own forward is bit-identical.
    The llama fixture has its own lm_head, the qwen3 one ties it to the embedding."""
    path = tiny_model if arch == "llama" else qwen3_model
    fresh, relaid = load(path), load(path)
    tokens = mx.array(_tokens(40, 50))[None]
    before = np.array(fresh.model(tokens))
    tied = lay_out_for_cpu(relaid.model)
    lay_out_for_cpu(relaid.model)  # idempotent: a second pass changes nothing
    assert (tied is not None) == fresh.model.args.tie_word_embeddings
    q_proj = relaid.model.layers[0].self_attn.q_proj.weight
    assert q_proj.shape == fresh.model.layers[0].self_attn.q_proj.weight.shape
    assert np.array_equal(np.array(relaid.model(tokens)), before)
    if tied is not None:
        embed = fresh.model.model.embed_tokens
        assert np.array_equal(np.array(tied), np.array(embed.weight).T)
        hidden = mx.random.normal((3, tied.shape[0]), key=mx.random.key(0))
        assert np.array_equal(np.array(hidden @ tied), np.array(embed.as_linear(hidden)))


def test_computed_rows_are_what_the_products_compute(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C products' tile (8 rows with 16-float vectors, 6 with 8-float ones), else
    the rows MLX's CPU products are padded to (none below 4 rows)."""
    if not native.products_enabled():
        pytest.skip("no C compiler here: the packed products cannot be built")
    tile = native.tile_rows()
    assert tile == {32: 8, 16: 6}[native.panel_width()]
    assert [_runner(loaded).computed_rows(n) for n in (1, tile, tile + 1)] == [tile, tile, 2 * tile]
    monkeypatch.setenv(native.PRODUCTS_DISABLE_ENV, "0")
    unpacked = _runner(loaded)
    assert [unpacked.computed_rows(n) for n in (2, 5, 17)] == [2, ROW_MULTIPLE, 2 * ROW_MULTIPLE]


def test_fast_exp_is_accurate_and_zero_weights_masked() -> None:
    x = mx.array(np.linspace(-87, 88, 200_001, dtype=np.float32))
    ref = np.exp(np.array(x, dtype=np.float64))
    rel = np.abs(np.array(fast_math.exp(x), dtype=np.float64) - ref) / ref
    assert rel.max() < 2e-7
    probs = np.array(fast_math.softmax(mx.array([[0.0, 1.0, fast_math.MASKED, 2.0]])))
    expected = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
    np.testing.assert_allclose(probs[0, [0, 1, 3]], expected, rtol=1e-6)
    assert probs[0, 2] < 1e-37


def test_loader_refuses_architectures_mlx_lm_lacks(tmp_path: Path) -> None:
    config = {"model_type": "no_such_arch", "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'no_such_arch' is not an architecture"):
        load(tmp_path)
    check_config({"model_type": "gemma2"}, source="x")  # the generic path runs it
    assert runs_fast({"model_type": "llama"})
    assert not runs_fast({"model_type": "llama", "layer_types": ["sliding_attention"]})
    assert not runs_fast({"model_type": "gemma3_text"})


def test_pool_size_follows_memory_and_caps(loaded: LoadedModel) -> None:
    spec = loaded.spec
    block_bytes = spec.kv_bytes_per_token * BLOCK
    by_memory = size_pool(
        spec,
        block_size=BLOCK,
        memory_fraction=0.5,
        max_num_seqs=8,
        max_model_len=2048,
        available_bytes=100 * block_bytes,
    )
    assert by_memory == 50
    capped = size_pool(
        spec,
        block_size=BLOCK,
        memory_fraction=0.5,
        max_num_seqs=2,
        max_model_len=64,
        available_bytes=1 << 40,
    )
    assert capped == max(16, 2 * (64 // BLOCK + 1))
    pool = KVPool(spec, num_blocks=4, block_size=BLOCK)
    assert pool.k[0].shape == (spec.num_kv_heads, 4 * BLOCK, spec.head_dim)
    assert pool.nbytes == 4 * block_bytes
