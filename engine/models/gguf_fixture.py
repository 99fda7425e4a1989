"""Synthetic GGUF files, written with llama.cpp's ``gguf`` package as its converter would.

A random-weight mlx-lm model (batchd.engine.models.arch_fixture) is written
under llama.cpp's tensor names, with its changes applied (llama's q/k rows
permuted for its rope, Gemma's norms stored as ``1 + w``), its metadata, and a
tokenizer: the fixture's byte-level BPE (``gpt2``) or a small SentencePiece
vocabulary (``llama``). Weight matrices are stored in the asked ggml type:
quantized by ``gguf.quants`` where it can, else random blocks of that type
(bytes below 0x3C keep every half-float scale finite and under 1), which is
all a converter test needs: the file's own dequantization is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import numpy as np
from mlx.utils import tree_flatten

from batchd.engine.models.gguf_arch import ARCHES, TOP_NAMES

# mlx-lm model_type -> GGUF general.architecture
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2"}
GGUF_ARCH |= {"gemma3_text": "gemma3", "phi3": "phi3"}


def _gguf_name(hf: str, arch: str) -> str:
    layer_names = {v: k for k, v in ARCHES[arch].layer_names.items()}
    if arch in ("gemma2", "gemma3"):
        layer_names["post_attention_layernorm"] = "post_attention_norm"
    parts = hf.split(".")
    if parts[1] == "layers":
        module, leaf = ".".join(parts[3:-1]), parts[-1]
        return f"blk.{parts[2]}.{layer_names[module]}.{leaf}"
    top = {v: k for k, v in TOP_NAMES.items()}
    return f"{top['.'.join(parts[:-1])]}.{parts[-1]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rope (convert_hf_to_gguf's LlamaModel.permute)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _stored(array: np.ndarray, qtype: Any, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """``array`` in ``qtype``: (data, raw dtype), quantized or random blocks."""
    import gguf
    from gguf import quants

    if qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    try:
        return quants.quantize(array.astype(np.float32), qtype), qtype
    except NotImplementedError:
        pass
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = array.shape
    return rng.integers(0, 0x3C, size=(rows, cols // block * size), dtype=np.uint8), qtype


def _add_arch_metadata(w: Any, arch: str, config: dict[str, Any]) -> None:
    """The metadata of one architecture's own features (windows, soft-capping, rope)."""
    if "sliding_window" in config:
        w.add_sliding_window(config["sliding_window"])
    if "sliding_window_pattern" in config:
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", config["sliding_window_pattern"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "phi3":
        w.add_rope_dimension_count(config["head_dim"])
        if "original_max_position_embeddings" in config:
            original = config["original_max_position_embeddings"]
            w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary: specials, 256 byte tokens, letters and merges."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581a", "\u2581b", "ab", "\u2581ab"]
    pieces += ["\u2581the", "th", "he", "\u2581t", "\u2581th"]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def write_gguf(
    path: str | Path,
    model: Any,
    config: dict[str, Any],
    *,
    qtype: Any = None,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    extra: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write ``model`` (an mlx-lm model of ``config``) as a GGUF file at ``path``.

    Matrices are stored as ``qtype`` (default F32), 1-D tensors as F32. With
    ``tokenizer_dir`` (a fixture's tokenizer.json) the vocabulary is byte-level BPE,
    else the SentencePiece vocabulary of :func:`spm_vocab` padded to the model's size.
    ``extra`` tensors are added as they are (e.g. ``rope_freqs.weight``); ``drop`` names
    metadata keys left out (to test refusals).
    """
    import gguf

    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    qtype = qtype or gguf.GGMLQuantizationType.F32
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    _add_arch_metadata(w, arch, config)
    vocab = config["vocab_size"]
    if tokenizer_dir is not None:
        spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        ordered = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
        tokens = [t for t, _ in ordered]
        added = {a["id"]: a["content"] for a in spec["added_tokens"]}
        tokens += [added[i] for i in range(len(tokens), vocab)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
        w.add_bos_token_id(tokens.index("<s>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
    else:
        tokens, scores, types = spm_vocab()
        pad = vocab - len(tokens)
        tokens += [f"<unused{i}>" for i in range(pad)]
        scores += [-1000.0] * pad
        types += [5] * pad
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    offset = ARCHES[arch].norm_offset
    flat: dict[str, Any] = dict(tree_flatten(model.parameters()))
    for hf, value in flat.items():
        array = np.array(value, dtype=np.float32)
        if ARCHES[arch].rope_traditional and hf.endswith("q_proj.weight"):
            array = _permute(array, config["num_attention_heads"])
        elif ARCHES[arch].rope_traditional and hf.endswith("k_proj.weight"):
            array = _permute(array, config["num_key_value_heads"])
        if "norm" in hf:
            array = array + offset
        data, raw = (array, None) if array.ndim < 2 else _stored(array, qtype, rng)
        w.add_tensor(_gguf_name(hf, arch), data, raw_dtype=raw)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    for key in drop:
        w.kv_data[0].pop(key, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
