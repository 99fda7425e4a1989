"""What each GGUF architecture is in mlx-lm's terms: config.json and tensor names.

llama.cpp's converter stores a model under its own names and with a few changes
of its own, undone here: llama's q/k rows are permuted for its rope (the model
then runs with ``rope_traditional: true`` instead of un-permuting); Gemma's norm
weights are stored as ``1 + w`` (mlx-lm's Gemma norms add the 1 themselves);
Llama 3.1/3.2's rope scaling is stored only as its per-frequency factors
(``rope_freqs``), from which the scaling's parameters are recovered and checked.

Problems are collected, not raised, so a file's every problem is reported at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchd.engine.models.gguf_header import meta_value

_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA = _COMMON | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3 = _COMMON | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class Problems:
    """Everything wrong with one file, each with the advice that fixes it."""

    lines: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)


Meta = dict[str, Any]


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture: its mlx-lm model_type, tensor names and config builder."""

    model_type: str
    layer_names: dict[str, str]
    config: Callable[[Meta, str, Problems], dict[str, Any]]
    rope_traditional: bool = False  # q/k rows permuted by llama.cpp (llama)
    norm_offset: float = 0.0  # subtracted from every norm weight (Gemma's 1 + w)


def _keys(meta: Meta, arch: str, problems: Problems) -> Callable[..., Any]:
    def key(name: str, default: Any = None) -> Any:
        value = meta_value(meta, f"{arch}.{name}", default)
        if value is None:
            problems.add(f"metadata {arch}.{name} is missing (re-convert with a current llama.cpp)")
            return 0
        return value

    return key


def _base(meta: Meta, arch: str, problems: Problems) -> dict[str, Any]:
    key = _keys(meta, arch, problems)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    heads_kv = key("attention.head_count_kv", heads)
    if not isinstance(heads_kv, int | float):
        problems.add(f"{arch}.attention.head_count_kv varies by layer; one value is needed")
        heads_kv = heads
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(heads_kv),
        "intermediate_size": int(key("feed_forward_length")),
        "head_dim": int(key("attention.key_length", hidden // max(heads, 1))),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "rope_scaling": None,
    }
    scaling = meta_value(meta, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = float(key("rope.scaling.factor", 1.0))
        config["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        problems.add(f"rope scaling {scaling!r} is not supported by GGUF import (linear is)")
    return config


def _llama(meta: Meta, arch: str, problems: Problems) -> dict[str, Any]:
    return _base(meta, arch, problems) | {"attention_bias": False, "mlp_bias": False}


def _qwen2(meta: Meta, arch: str, problems: Problems) -> dict[str, Any]:
    return _base(meta, arch, problems)


def _gemma2(meta: Meta, arch: str, problems: Problems) -> dict[str, Any]:
    key = _keys(meta, arch, problems)
    config = _base(meta, arch, problems)
    return config | {
        "attn_logit_softcapping": float(key("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(key("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": config["head_dim"],
        "sliding_window": int(key("attention.sliding_window", 4096)),
    }


def _gemma3(meta: Meta, arch: str, problems: Problems) -> dict[str, Any]:
    key = _keys(meta, arch, problems)
    config = _base(meta, arch, problems)
    # llama.cpp fixes these for Gemma 3: local layers' rope base 10000, 5 local : 1 global
    # unless the file says otherwise (an int, or one bool per layer: true = sliding).
    pattern = meta_value(meta, f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        pattern = pattern.index(False) + 1 if False in pattern else len(pattern) + 1
    return config | {
        "query_pre_attn_scalar": config["head_dim"],
        "sliding_window": int(key("attention.sliding_window", 512)),
        "sliding_window_pattern": int(pattern),
        "rope_local_base_freq": 10000.0,
    }


def _phi3(meta: Meta, arch: str, problems: Problems) -> dict[str, Any]:
    key = _keys(meta, arch, problems)
    config = _base(meta, arch, problems)
    rotary = int(key("rope.dimension_count", config["head_dim"]))
    original = meta_value(meta, f"{arch}.rope.scaling.original_context_length")
    return config | {
        "partial_rotary_factor": rotary / max(config["head_dim"], 1),
        "original_max_position_embeddings": int(original or config["max_position_embeddings"]),
    }


ARCHES: dict[str, Arch] = {
    "llama": Arch("llama", _COMMON, _llama, rope_traditional=True),
    "qwen2": Arch("qwen2", _COMMON, _qwen2),
    "qwen3": Arch("qwen3", _COMMON, _qwen2),
    "gemma2": Arch("gemma2", _GEMMA, _gemma2, norm_offset=1.0),
    "gemma3": Arch("gemma3_text", _GEMMA, _gemma3, norm_offset=1.0),
    "phi3": Arch("phi3", _PHI3, _phi3),
}


def llama3_rope_scaling(
    factors: np.ndarray, *, head_dim: int, theta: float, problems: Problems
) -> dict[str, Any] | None:
    """Llama 3.1/3.2's rope_scaling from the per-frequency divisors llama.cpp stores
    (``rope_freqs``): the known parameters (low 1, high 4, original context 8192; factor
    its largest divisor) recomputed and compared; a file whose divisors follow another
    rule is a problem."""
    factor = float(factors.max())
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_divisors(scaling, head_dim, theta), factors, rtol=1e-3):
        problems.add(
            "rope_freqs (Llama 3.1-style rope scaling) does not follow the llama3 rule "
            "with low 1, high 4, original context 8192; convert from the Hugging Face "
            "checkpoint instead (mlx_lm.convert)"
        )
        return None
    return scaling


def _llama3_divisors(scaling: dict[str, Any], dims: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter writes for a llama3 rope_scaling."""
    freqs = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)
