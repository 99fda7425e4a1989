"""A float32 model's weights packed once for the C products (engine/forward/products.c).

Why: on a CPU, OpenBLAS packs every weight into its own layout again on each call,
which at decode's few rows costs as much as the arithmetic; the C products read
weights packed here at load (docs/engine.md, On a CPU). Each layer's q, k and v projections
become one packed product, gate and up another (with SiLU applied as it is written),
so a layer runs four products instead of seven.

Only the shapes the runner knows are packed: llama-family layers whose seven
projections are plain float32 ``nn.Linear`` and whose norms are ``nn.RMSNorm``.
Anything else (a quantized layer, another norm) gets None: the runner then keeps
MLX's products. The packed copies add the layers' weights to memory once more (the
MLX weights stay, for the MLX path and for whoever else holds the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchd.engine.forward import native
from batchd.engine.forward.native import PackedWeight
from batchd.engine.models.loader import ModelSpec

# (weight [dim], eps) of an RMSNorm
Norm = tuple[np.ndarray, float]


@dataclass(frozen=True)
class PackedLayer:
    input_norm: Norm
    # qwen3's per-head q and k RMSNorms: (q weight, k weight, eps)
    qk_norms: tuple[np.ndarray, np.ndarray, float] | None
    qkv: PackedWeight
    o: PackedWeight
    post_norm: Norm
    gate_up: PackedWeight
    down: PackedWeight


@dataclass(frozen=True)
class PackedModel:
    layers: list[PackedLayer]
    final_norm: Norm
    head: PackedWeight
    # RoPE pairs (2i, 2i + 1) rather than (i, i + dim / 2)
    rope_traditional: bool


def pack_model(model: Any, spec: ModelSpec) -> PackedModel | None:
    """The packed weights of ``model`` (an mlx-lm llama-family model), or None when a
    part of it is not a plain float32 Linear or RMSNorm, or its RoPE rotates only part
    of each head."""
    inner = model.model
    layers = []
    ropes = {
        (getattr(layer.self_attn.rope, "dims", None), _traditional(layer)) for layer in inner.layers
    }
    if len(ropes) != 1 or next(iter(ropes))[0] != spec.head_dim:
        return None
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norms = None
        if spec.qk_norm:
            if not (_rms_norm(attn.q_norm) and _rms_norm(attn.k_norm)):
                return None
            (q_weight, eps), (k_weight, _) = _norm(attn.q_norm), _norm(attn.k_norm)
            qk_norms = (q_weight, k_weight, eps)
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if not all(_plain_linear(p) for p in projections) or not all(map(_rms_norm, norms)):
            return None
        q, k, v = (_columns(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        biases = [_bias(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        qkv_bias = None
        if any(b is not None for b in biases):
            qkv_bias = np.concatenate(
                [
                    b if b is not None else np.zeros(w.shape[1], np.float32)
                    for b, w in zip(biases, (q, k, v), strict=True)
                ]
            )
        gate_bias, up_bias = _bias(mlp.gate_proj), _bias(mlp.up_proj)
        if (gate_bias is None) != (up_bias is None):
            return None
        layers.append(
            PackedLayer(
                input_norm=_norm(layer.input_layernorm),
                qk_norms=qk_norms,
                qkv=native.pack(np.concatenate([q, k, v], axis=1), qkv_bias),
                o=native.pack(_columns(attn.o_proj), _bias(attn.o_proj)),
                post_norm=_norm(layer.post_attention_layernorm),
                gate_up=native.pack_swiglu(
                    _columns(mlp.gate_proj),
                    _columns(mlp.up_proj),
                    None if gate_bias is None or up_bias is None else (gate_bias, up_bias),
                ),
                down=native.pack(_columns(mlp.down_proj), _bias(mlp.down_proj)),
            )
        )
    if not _rms_norm(inner.norm):
        return None
    if getattr(model.args, "tie_word_embeddings", False):
        embed = inner.embed_tokens
        if type(embed) is not nn.Embedding or embed.weight.dtype != mx.float32:
            return None
        head = native.pack(np.array(embed.weight).T)
    elif _plain_linear(model.lm_head):
        head = native.pack(_columns(model.lm_head), _bias(model.lm_head))
    else:
        return None
    return PackedModel(layers, _norm(inner.norm), head, rope_traditional=next(iter(ropes))[1])


def _traditional(layer: Any) -> bool:
    return bool(getattr(layer.self_attn.rope, "traditional", False))


def _plain_linear(module: Any) -> bool:
    return type(module) is nn.Linear and module.weight.dtype == mx.float32


def _rms_norm(module: Any) -> bool:
    return type(module) is nn.RMSNorm and module.weight.dtype == mx.float32


def _columns(linear: nn.Linear) -> np.ndarray:
    """The weight as ``x @ w`` reads it: [in, out]."""
    return np.array(linear.weight).T


def _bias(linear: nn.Linear) -> np.ndarray | None:
    return np.array(linear.bias) if "bias" in linear else None


def _norm(norm: nn.RMSNorm) -> Norm:
    return np.array(norm.weight), float(norm.eps)
