"""Quantized KV blocks (EngineConfig.kv_bits): the pool's round trip, attention over it,
its size at a memory budget, the options it refuses, and greedy parity with mlx-lm run
with its QuantizedKVCache from the first token (the same semantics: every token attends
to K/V quantized group-wise per token and head)."""

from __future__ import annotations

from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache
from parity_harness import Req, random_requests, shared_prefix_requests

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.forward import kv_quant
from batchd.engine.forward.kv_pool import KVPool, plan_pool
from batchd.engine.forward.kv_quant import KVQuant, take_blocks
from batchd.engine.forward.paged_attention import decode_attention, make_decode_group
from batchd.engine.models.arch_fixture import VOCAB as ARCH_VOCAB
from batchd.engine.models.arch_fixture import make_arch_model
from batchd.engine.models.loader import LoadedModel, ModelSpec, load
from support.blas_rounding import quantized_gap

VOCAB = 1024
# The tiny fixture's head_dim is 32: the largest group that divides it.
GROUP = 32


def _spec(dtype: mx.Dtype, head_dim: int = 64) -> ModelSpec:
    """SmolLM2-135M's shapes (30 layers, 3 KV heads) in ``dtype``."""
    return ModelSpec(
        model_type="llama",
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=head_dim,
        vocab_size=49152,
        max_position_embeddings=8192,
        dtype=dtype,
        qk_norm=False,
    )


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_round_trip_within_half_a_step_of_their_group(bits: int) -> None:
    spec = _spec(mx.float32)
    pool = KVPool(spec, num_blocks=8, block_size=4, quant=KVQuant(bits, 64))
    k = mx.random.normal((3, 12, 64), key=mx.random.key(1)) * 3
    v = mx.random.normal((3, 12, 64), key=mx.random.key(2))
    slots = mx.array(np.arange(4, 16, dtype=np.int32))  # blocks 1, 2 and 3
    pool.write(5, slots, k, v)
    k_blocks, v_blocks = pool.blocked(5)
    table = mx.array([[1, 2, 3], [0, 0, 0]], dtype=mx.int32)
    for blocks, want in ((k_blocks, k), (v_blocks, v)):
        got = take_blocks(blocks, table)
        assert got.shape == (3, 2, 3, 4, 64) and got.dtype == mx.float32
        read = np.array(got[:, 0].reshape(3, 12, 64))
        # MLX's grid: 2**bits levels a step apart spanning the group, one end snapped so
        # that zero is a level; the other end may fall up to a step short.
        spread = np.ptp(np.array(want), axis=-1, keepdims=True)
        step = spread / (2**bits - 1) * (1 + 2 / 2**bits)
        error = np.abs(read - np.array(want)) / step
        assert error.max() <= 1, error.max()
        assert 0.15 < error.mean() < 0.35  # rounding to the nearest level, not truncating
        assert not np.array(got[:, 1]).any()  # block 0 was never written: zeros
    assert pool.k == [] and pool.v == []  # the float storage is not allocated beside


def test_decode_attention_reads_the_dequantized_blocks() -> None:
    """The gather path over quantized blocks equals attention computed by hand over
    dequantize(quantize(K/V))."""
    quant = KVQuant(8, 32)
    spec = ModelSpec("llama", 1, 4, 2, 32, 64, None, mx.float32, False)
    pool = KVPool(spec, num_blocks=6, block_size=4, quant=quant)
    k = mx.random.normal((2, 10, 32), key=mx.random.key(3))
    v = mx.random.normal((2, 10, 32), key=mx.random.key(4))
    pool.write(0, mx.array(np.arange(8, 18, dtype=np.int32)), k, v)  # blocks 2, 3, 4
    q = mx.random.normal((1, 4, 32), key=mx.random.key(5))
    group = make_decode_group(0, [[2, 3, 4]], [10], block_size=4, num_kv_heads=2)
    got = np.array(decode_attention(q, *pool.blocked(0), group, scale=0.25))
    keys = np.array(kv_quant.round_trip(quant, k))
    values = np.array(kv_quant.round_trip(quant, v))
    want = []
    for head in range(4):
        scores = keys[head // 2] @ np.array(q[0, head]) * 0.25
        weights = np.exp(scores - scores.max())
        want.append((weights / weights.sum()) @ values[head // 2])
    np.testing.assert_allclose(got[0], np.concatenate(want), atol=1e-5)
    # Not the float answer: the test would see a pool that skipped quantizing.
    assert np.abs(keys - np.array(k)).max() > 1e-3


@pytest.mark.parametrize(
    ("dtype", "bits", "at_least"),
    [(mx.float16, 8, 1.8), (mx.float32, 8, 3.5), (mx.float16, 4, 3.2), (mx.float32, 4, 6.4)],
)
def test_a_memory_budget_holds_more_blocks_quantized(
    dtype: mx.Dtype, bits: int, at_least: float
) -> None:
    spec = _spec(dtype)
    budget = {
        "block_size": 16,
        "max_num_seqs": 256,
        "max_model_len": 8192,
        "tokens_per_seq": 8192,
        "memory_fraction": 1.0,
        "available_bytes": 256 * 2**20,
    }
    plain = plan_pool(spec, **budget)  # type: ignore[arg-type]
    quantized = plan_pool(spec, quant=KVQuant(bits, 64), **budget)  # type: ignore[arg-type]
    assert quantized.bound.value == plain.bound.value == "memory"
    assert quantized.blocks >= at_least * plain.blocks
    assert quantized.mib <= 256 and quantized.storage == f"{bits}-bit KV (groups of 64)"
    # The pool allocated at that size takes the bytes the plan counted.
    small = KVPool(_spec(dtype), num_blocks=2, block_size=16, quant=KVQuant(bits, 64))
    assert small.nbytes == 2 * quantized.block_bytes


def test_unsupported_widths_and_groups_are_refused(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.kv_bits must be None or one of"):
        EngineConfig(kv_bits=3)
    with pytest.raises(ValueError, match=r"EngineConfig\.kv_group_size must be one of"):
        EngineConfig(kv_bits=8, kv_group_size=48)
    # tiny's heads are 32 values: groups of 64 cannot split them.
    with pytest.raises(ValueError, match=r"kv_group_size=64 does not divide .* head_dim 32"):
        LLMEngine(tiny, EngineConfig(num_kv_blocks=16, kv_bits=8, kv_group_size=64))
    with pytest.raises(ValueError, match="not a multiple of any"):
        KVQuant(8, 32).check(48)


def _reference(model: object, req: Req, bits: int | None) -> tuple[list[int], list[mx.array]]:
    """mlx-lm alone on ``req``, greedy: its tokens and each step's logprobs, with a
    QuantizedKVCache in every layer from the first token (its generate's kv_bits quantizes
    only after the first prompt chunk), or its float cache (``bits`` None)."""
    layers = len(model.layers)  # type: ignore[attr-defined]
    cache = None if bits is None else [QuantizedKVCache(GROUP, bits) for _ in range(layers)]
    tokens, logprobs = [], []
    for token, lp in generate_step(
        mx.array(req.prompt), model, max_tokens=req.max_tokens, prompt_cache=cache
    ):
        tokens.append(int(token))
        logprobs.append(lp)
    return tokens, logprobs


def _run(eng: LLMEngine, reqs: list[Req], *, waves: int) -> list[list[tuple[int, float]]]:
    """Greedy (token, logprob) of each request, submitted in ``waves`` a few steps apart."""
    outputs: list[list[tuple[int, float]]] = [[] for _ in reqs]
    per_wave = -(-len(reqs) // waves)
    step = 0
    while step < waves * 3 or eng.has_unfinished():
        if step % 3 == 0 and step // 3 < waves:
            for i in range(step // 3 * per_wave, min(len(reqs), (step // 3 + 1) * per_wave)):
                params = SamplingParams(max_tokens=reqs[i].max_tokens, ignore_eos=True)
                eng.add_request(f"r{i}", prompt_token_ids=list(reqs[i].prompt), params=params)
        for out in eng.step():
            outputs[int(out.request_id[1:])].append((out.token_id, out.logprob))
        step += 1
    return outputs


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_equals_mlx_lm_quantized_cache_in_mixed_batches(
    tiny: LoadedModel, bits: int
) -> None:
    """Prefill chunks beside decodes, chunked prompts, prefix-cache hits and preemption:
    each request equals mlx-lm's, token for token, and its logprobs agree to float
    rounding but for the rare K/V value that rounding moves across a level of the grid."""
    reqs = random_requests(10, seed=7, vocab=VOCAB, prompt_len=(1, 120), max_tokens=(1, 24))
    reqs += shared_prefix_requests(6, seed=8, vocab=VOCAB, prefixes=2)
    config = EngineConfig(
        max_num_seqs=6, max_num_batched_tokens=48, num_kv_blocks=40, kv_bits=bits, kv_group_size=32
    )
    eng = LLMEngine(tiny, config)
    chunks: set[str] = set()
    original_step = eng.step

    def watched_step() -> list:  # type: ignore[type-arg]
        outputs = original_step()
        for c in eng.last_step_stats.chunks:
            if c.kind == "prefill":
                chunks.add("continued" if c.start > 0 else "first")
        if eng.last_step_stats.num_decode_tokens and eng.last_step_stats.num_prefill_tokens:
            chunks.add("mixed")
        return outputs

    eng.step = watched_step  # type: ignore[method-assign]
    got = _run(eng, reqs, waves=4)
    assert chunks == {"first", "continued", "mixed"}
    assert eng.last_step_stats.prefix_cache_hit_rate > 0
    assert eng.last_step_stats.num_preemptions_total > 0
    gaps: list[float] = []
    drift_from_float = 0.0
    for i, req in enumerate(reqs):
        tokens, logprobs = _reference(tiny.model, req, bits)
        assert [t for t, _ in got[i]] == tokens, f"request {i}"
        gaps += [abs(lp - float(ref[t])) for (t, lp), ref in zip(got[i], logprobs, strict=True)]
        _, plain = _reference(tiny.model, Req(req.prompt, 1), None)
        drift_from_float = max(drift_from_float, float(mx.abs(plain[0] - logprobs[0]).max()))
    # Float rounding differs between a packed batch and a lone request, as in float parity;
    # where it moves a K/V value across a rounding boundary of the grid, that value moves a
    # whole level, so a few logprobs differ more than float rounding alone would explain.
    # How many cross depends on the BLAS kernels (support.blas_rounding).
    bound = quantized_gap()
    assert float(np.quantile(gaps, 0.95)) < bound.p95, sorted(gaps)[-5:]
    assert max(gaps) < bound.largest, sorted(gaps)[-5:]
    # The oracle is not float in disguise: quantizing moved its logprobs well beyond that.
    assert drift_from_float > 2e-3, drift_from_float


def test_8bit_on_the_generic_path_equals_mlx_lm_quantized_cache(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """mlx-lm's own olmo2 classes over the quantized pool (heads of 32 values)."""
    shape = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    loaded = load(make_arch_model(tmp_path_factory.mktemp("arch"), "olmo2", overrides=shape))
    assert loaded.spec.generic and loaded.spec.head_dim == GROUP
    reqs = random_requests(6, seed=9, vocab=ARCH_VOCAB, prompt_len=(1, 80), max_tokens=(1, 16))
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, kv_bits=8, kv_group_size=32
    )
    got = _run(LLMEngine(loaded, config), reqs, waves=2)
    for i, req in enumerate(reqs):
        tokens, _ = _reference(loaded.model, req, 8)
        assert [t for t, _ in got[i]] == tokens, f"request {i}"
