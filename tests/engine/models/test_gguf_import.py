"""GGUF import through the gguf package: every architecture and tensor type it converts.

The files are written here by batchd.engine.models.gguf_fixture from tiny random-weight
mlx-lm models, as llama.cpp's converter writes them (names, permuted q/k, Gemma's
``1 + w`` norms, metadata, tokenizers). A converted model must compute what the original
did, and every converted weight must equal the gguf package's own dequantization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten
from parity_harness import Reference, Req, check_parity, run_engine

from batchd.engine import EngineConfig, LLMEngine
from batchd.engine.models.arch_fixture import _BASE, ARCH_CONFIGS, build_model
from batchd.engine.models.gguf_convert import KEPT_TYPES, convert_gguf, dequantizable_types
from batchd.engine.models.gguf_fixture import write_gguf
from batchd.engine.models.loader import load
from batchd.engine.models.model_fixture import build_tokenizer

GGUF_ARCHES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]
QUANT_TYPES = [t for t in dequantizable_types() if t != "F32"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    build_tokenizer(1024, 0, out)
    return out


def _config(arch: str, **shape: Any) -> dict[str, Any]:
    return {"model_type": arch, **_BASE, **ARCH_CONFIGS.get(arch, {}), **shape}


def _engine_matches_mlx_lm(path: Path) -> None:
    loaded = load(path)
    reqs = [Req(tuple(range(5 + i, 40 + 3 * i)), 6) for i in range(4)]
    eng = LLMEngine(loaded, EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256))
    check_parity(Reference(loaded.model), reqs, run_engine(eng, reqs, waves=2))


@pytest.mark.parametrize("arch", GGUF_ARCHES)
def test_each_architecture_converts_to_the_same_model(
    arch: str, tmp_path: Path, bpe_dir: Path
) -> None:
    config = _config(arch)
    model = build_model(config)
    spm = arch.startswith("gemma") or arch == "phi3"
    path = write_gguf(tmp_path / "m.gguf", model, config, tokenizer_dir=None if spm else bpe_dir)
    out = convert_gguf(path, tmp_path / "out", keep_quantized=False)
    loaded = load(out)
    x = mx.array([[5, 6, 7, 8, 300, 2]])
    np.testing.assert_allclose(np.array(loaded.model(x)), np.array(model(x)), atol=2e-4)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the ab a")).endswith("the ab a")
    assert loaded.tokenizer.chat_template
    _engine_matches_mlx_lm(out)


def test_llama31_rope_freqs_become_llama3_rope_scaling(tmp_path: Path, bpe_dir: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = _config("llama", rope_theta=500000.0, rope_scaling=scaling)
    model = build_model(config)
    path = tmp_path / "m.gguf"
    from batchd.engine.models.gguf_arch import _llama3_divisors

    freqs = _llama3_divisors(scaling, config["head_dim"], config["rope_theta"])
    write_gguf(path, model, config, tokenizer_dir=bpe_dir, extra={"rope_freqs.weight": freqs})
    out = convert_gguf(path, tmp_path / "out", keep_quantized=False)
    loaded = load(out)
    assert loaded.config["rope_scaling"]["rope_type"] == "llama3"
    x = mx.array([[5, 6, 7, 8, 300, 2]])
    np.testing.assert_allclose(np.array(loaded.model(x)), np.array(model(x)), atol=2e-4)


def test_phi3_rope_factors_become_longrope_scaling(tmp_path: Path) -> None:
    """Phi-3 128k / Phi-4-mini: llama.cpp's rope_factors_long/short tensors and original
    context become a longrope rope_scaling; the model computes what the original did past
    the original context, and the engine matches mlx-lm there."""
    long = [1.0, 1.2, 1.6, 2.4, 3.5, 5.0, 8.0, 12.0]
    scaling = {"type": "longrope", "long_factor": long, "short_factor": [1.0] * 8}
    config = _config("phi3", max_position_embeddings=1024, original_max_position_embeddings=64) | {
        "rope_scaling": scaling
    }
    model = build_model(config)
    factors = {
        "rope_factors_long.weight": np.asarray(long, np.float32),
        "rope_factors_short.weight": np.ones(8, np.float32),
    }
    path = write_gguf(tmp_path / "m.gguf", model, config, extra=factors)
    out = convert_gguf(path, tmp_path / "out", keep_quantized=False)
    loaded = load(out)
    assert loaded.config["rope_scaling"]["type"] == "longrope"
    assert loaded.config["original_max_position_embeddings"] == 64
    assert type(loaded.model.layers[0].self_attn.rope).__name__ == "SuScaledRoPE"
    x = mx.array([list(range(5, 105))])  # past the original context of 64
    np.testing.assert_allclose(np.array(loaded.model(x)), np.array(model(x)), atol=2e-4)
    reqs = [Req(tuple(range(5 + i, 60 + 9 * i)), 16) for i in range(4)]
    eng = LLMEngine(loaded, EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256))
    report = check_parity(Reference(loaded.model), reqs, run_engine(eng, reqs, waves=2))
    assert not report.divergences, report.divergences


def _file_weights(path: Path) -> dict[str, np.ndarray]:
    from gguf import quants

    reader = gguf.GGUFReader(str(path))
    return {
        t.name: np.asarray(quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
        for t in reader.tensors
    }


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_each_tensor_type_converts_to_its_dequantization(
    qtype: str, tmp_path: Path, bpe_dir: Path
) -> None:
    # 256 columns: a K-quant block holds 256 weights.
    config = _config("qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    config["head_dim"] = 64
    model = build_model(config)
    path = write_gguf(tmp_path / "m.gguf", model, config, qtype=Q[qtype], tokenizer_dir=bpe_dir)
    out = convert_gguf(path, tmp_path / "out", keep_quantized=False)
    converted = dict(mx.load(str(out / "model.safetensors")).items())
    stored = _file_weights(path)
    np.testing.assert_array_equal(
        np.array(converted["model.layers.0.mlp.down_proj.weight"]),
        stored["blk.0.ffn_down.weight"],
    )
    np.testing.assert_array_equal(
        np.array(converted["model.embed_tokens.weight"]), stored["token_embd.weight"]
    )
    loaded = load(out)
    assert np.isfinite(np.array(loaded.model(mx.array([[5, 6, 7]])))).all()
    _engine_matches_mlx_lm(out)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_kept_quantized_types_are_exact_mlx_affine(
    qtype: str, tmp_path: Path, bpe_dir: Path
) -> None:
    config = _config("llama")
    model = build_model(config)
    path = write_gguf(tmp_path / "m.gguf", model, config, qtype=Q[qtype], tokenizer_dir=bpe_dir)
    out = convert_gguf(path, tmp_path / "out", keep_quantized=True)
    loaded = load(out)
    bits = 8 if qtype == "Q8_0" else 4
    assert loaded.config["quantization"]["model.layers.0.mlp.up_proj"]["bits"] == bits
    up = loaded.model.model.layers[0].mlp.up_proj
    got = mx.dequantize(up.weight, up.scales, up.biases, group_size=32, bits=bits)
    want = _file_weights(path)["blk.0.ffn_up.weight"]
    np.testing.assert_allclose(np.array(got), want, rtol=1e-3, atol=1e-3)
    _engine_matches_mlx_lm(out)


def test_every_problem_of_a_file_is_listed_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv9")
    w.add_tokenizer_model("bert")
    w.add_token_list(["a", "b"])
    _, size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, size), dtype=np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_error()) as info:
        convert_gguf(path, tmp_path / "out")
    message = str(info.value)
    assert "3 problems" in message, message
    assert "architecture 'rwkv9' is not supported" in message
    assert "tensor type Q8_K (1 tensors, e.g. blk.0.attn_q.weight)" in message
    assert "tokenizer.ggml.model 'bert' is not supported" in message
    assert not (tmp_path / "out").exists()


def test_missing_metadata_is_listed_with_the_rest(tmp_path: Path, bpe_dir: Path) -> None:
    config = _config("llama")
    model = build_model(config)
    path = write_gguf(
        tmp_path / "m.gguf", model, config, tokenizer_dir=bpe_dir, drop=("llama.block_count",)
    )
    with pytest.raises(gguf_error(), match="metadata llama.block_count is missing"):
        convert_gguf(path, tmp_path / "out")


def gguf_error() -> type[Exception]:
    from batchd.engine.models.gguf_header import GGUFError

    return GGUFError


def _names(model: Any) -> list[str]:
    return [k for k, _ in tree_flatten(model.parameters())]
