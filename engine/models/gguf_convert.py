"""Convert a llama-family GGUF file into an mlx-lm model directory.

GGUF is how most local models are held (llama.cpp, Ollama, LM Studio);
mlx-lm does not load it. ``mx.load`` reads it, though: quantized tensors
(Q4_0, Q4_1, Q8_0) come back as MLX affine triples (weight, scales,
biases; group size 32). Three things differ from a Hugging Face checkpoint
and are fixed here: tensor names, the q/k projections (stored permuted
for llama.cpp's rope, so the model runs with ``rope_traditional: true``
instead of un-permuting), and the tokenizer (see gguf_tokenizer).

MLX's quantized matmul on CPU is single-threaded while float32 uses
OpenBLAS, so on a machine without a GPU the weights are dequantized to
float32 by default (2-3x faster decode); on Metal or CUDA they stay quantized.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.engine.models.gguf_header import GGUFError, check_supported, meta_value
from batchd.engine.models.gguf_tokenizer import write_tokenizer

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # every GGUF block type mx.load reads has 32 weights per block
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_TOP = re.compile(r"(\w+)\.(weight|scales|biases)$")


def gpu_available() -> bool:
    """Whether MLX has a GPU here (quantized weights are the fast path there)."""
    return bool(mx.metal.is_available() or mx.cuda.is_available())


def _hf_name(name: str, *, source: str) -> str:
    """The Hugging Face / mlx-lm parameter name of a GGUF tensor."""
    if m := _BLOCK.match(name):
        layer, part, leaf = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{leaf}"
    elif (m := _TOP.match(name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"{source}: tensor {name!r} has no llama counterpart (not a plain llama?)")


def model_config(metadata: dict[str, Any], *, source: str) -> dict[str, Any]:
    """config.json (mlx-lm llama form) from the GGUF's ``llama.*`` metadata."""
    arch = meta_value(metadata, "general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"{source}: architecture {arch!r} is not supported; GGUF import takes llama-family "
            "models (general.architecture = llama)"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta_value(metadata, f"llama.{name}", default)
        if value is None:
            raise GGUFError(f"{source}: metadata llama.{name} is missing")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    if meta_value(metadata, "llama.rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"{source}: rope scaling is not supported by GGUF import yet")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "intermediate_size": int(key("feed_forward_length")),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "rope_scaling": None,
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(key("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "attention_bias": False,
        "mlp_bias": False,
    }


def _weights(
    arrays: dict[str, mx.array], *, keep_quantized: bool, source: str
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Renamed weights (dequantized to float32 unless kept) and the quantization config."""
    weights: dict[str, mx.array] = {}
    quantization: dict[str, Any] = {}
    for name, array in arrays.items():
        if name.endswith((".scales", ".biases")):
            continue
        if name == "rope_freqs.weight":
            raise GGUFError(f"{source}: rope frequency factors (llama 3.1 rope) are not supported")
        hf = _hf_name(name, source=source)
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" not in arrays:
            weights[hf] = array.astype(mx.float32)
            continue
        scales, biases = arrays[f"{stem}.scales"], arrays[f"{stem}.biases"]
        bits = array.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
        if keep_quantized:
            module = hf.removesuffix(".weight")
            weights.update({hf: array, f"{module}.scales": scales, f"{module}.biases": biases})
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits}
        else:
            weights[hf] = mx.dequantize(
                array, scales, biases, group_size=GROUP_SIZE, bits=bits
            ).astype(mx.float32)
    return weights, quantization


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, keep_quantized: bool | None = None
) -> Path:
    """Write an mlx-lm model directory converted from ``gguf_path``; returns it.

    ``keep_quantized=None`` keeps quantized weights only where a GPU is
    available. The directory is written beside ``out_dir`` and moved into
    place last, so an interrupted conversion never leaves a half model.
    Raises GGUFError (a ValueError) naming what is unsupported.
    """
    source, out = str(gguf_path), Path(out_dir)
    check_supported(gguf_path)
    keep = gpu_available() if keep_quantized is None else keep_quantized
    loaded: Any = mx.load(source, return_metadata=True)
    arrays, metadata = loaded
    config = model_config(metadata, source=source)
    weights, quantization = _weights(arrays, keep_quantized=keep, source=source)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    if quantization:
        bits = max(q["bits"] for q in quantization.values())
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits, **quantization}
    config["torch_dtype"] = "float32"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        work = Path(tmp) / "model"
        work.mkdir()
        config.update(write_tokenizer(metadata, work, source=source))
        mx.save_safetensors(str(work / "model.safetensors"), weights, metadata={"format": "mlx"})
        (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    log.info("converted %s to %s (%s)", source, out, "quantized" if keep else "float32")
    return out
