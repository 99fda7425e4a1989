"""Tiny random-weight models of any mlx-lm architecture, for the generic path's tests.

A fixture is an ordinary model directory (config.json, safetensors, the byte-level
BPE tokenizer of batchd.engine.models.model_fixture), built from mlx-lm's own
ModelArgs and Model: hidden 64, 2 layers, 4 heads over 2 KV heads, vocabulary
1024. Weights are seeded; the output head is scaled so the logits spread like a
trained model's (near-ties rare, as model_fixture explains). The presets built here
(batchd.engine.models.presets.ARCH_PRESETS) override that shape; one in bfloat16
(bench-llama8b, 8B parameters) is drawn by MLX on the default device instead.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from batchd.engine.models.model_fixture import BOS, EOS, build_tokenizer

VOCAB = 1024
_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# A window shorter than the tests' prompts, so the window decides outputs.
WINDOW = 24
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}

# Per architecture: what mlx-lm's ModelArgs needs beyond the base shape.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 16, "tie_word_embeddings": True},
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": WINDOW,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 10000.0,
        "rope_global_base_freq": 1000000.0,
        "tie_word_embeddings": True,
    },
    "phi3": {},
    "qwen3_moe": {
        **_MOE,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": True,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "smollm3": {"no_rope_layer_interval": 2},
    "olmo2": {},
    "granite": {
        "logits_scaling": 2.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "starcoder2": {"norm_epsilon": 1e-5, "use_bias": True},
    "glm4": {"partial_rotary_factor": 0.5, "attention_bias": True},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "olmo3": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # Every layer windowed: the blocks a sequence's window has passed go back to the pool.
    "exaone_moe": {
        **_MOE,
        "num_shared_experts": 1,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "is_moe_layer": [False, True],
    },
}


def arch_config(arch: str) -> dict[str, Any]:
    """The config.json of the ``arch`` fixture (without token ids); an architecture with
    no entry in ARCH_CONFIGS (e.g. a preset's ``llama``) takes the base shape alone."""
    return {"model_type": arch, **_BASE, **ARCH_CONFIGS.get(arch, {})}


def build_model(config: dict[str, Any], *, seed: int = 0) -> Any:
    """mlx-lm's Model for ``config`` with seeded random weights in its ``torch_dtype``.

    float32 (every test fixture): NumPy draws, byte-identical on every machine. Any
    other dtype (bench-llama8b, 16 GB in bfloat16): see _draw_in_dtype.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    dtype = getattr(mx, str(config.get("torch_dtype", "float32")))
    if dtype == mx.float32:

        def draw(path: str, value: mx.array) -> mx.array:
            if "norm" in path or value.ndim < 2:
                return value  # norms, biases and scales keep mlx-lm's init
            return mx.array((rng.standard_normal(value.shape) * 0.15).astype(np.float32))

        model.update(tree_map_with_path(draw, model.parameters()))
    else:
        _draw_in_dtype(model, dtype, seed)
    _spread_logits(model, rng, int(config["vocab_size"]))
    return model


def _draw_in_dtype(model: Any, dtype: mx.Dtype, seed: int) -> None:
    """Replace every weight by MLX's seeded normal draw made in ``dtype`` on the default
    device (a GPU's in seconds), of standard deviation 1/sqrt(fan-in) so activations stay
    near 1 at any width; norms, biases and scales keep mlx-lm's init, cast to ``dtype``.

    Each tensor is evaluated as it is drawn, so peak memory is the model plus one draw:
    NumPy's float32 draws of an 8B model would take minutes and twice its memory, and
    mlx-lm's own float32 init, never evaluated, is dropped.
    """
    params: Any = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    for index, (path, value) in enumerate(params):
        if "norm" in path or value.ndim < 2:
            drawn = value.astype(dtype)
        else:
            scale = float(value.shape[-1]) ** -0.5
            drawn = mx.random.normal(value.shape, dtype=dtype, scale=scale, key=keys[index])
        mx.eval(drawn)
        model.load_weights([(path, drawn)], strict=False)


def _spread_logits(model: Any, rng: np.random.Generator, vocab: int) -> None:
    """Scale the output head (or the tied embedding) until the logits' spread is ~4."""
    probe = mx.array(rng.integers(4, vocab, size=(1, 32)), dtype=mx.int32)
    named = dict(tree_flatten(model.parameters()))
    head = next((k for k in named if k.endswith("lm_head.weight")), None)
    head = head or next((k for k in named if k.endswith("embed_tokens.weight")), None)
    if head is None:
        return
    for _ in range(3):
        std = float(np.std(np.array(model(probe).astype(mx.float32))))
        if not np.isfinite(std) or std == 0:
            break
        named = dict(tree_flatten(model.parameters()))
        model.load_weights([(head, named[head] * (4.0 / std))], strict=False)


def make_arch_model(
    out_dir: str | Path, arch: str, *, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write the ``arch`` fixture's model directory (its config updated with
    ``overrides``, e.g. a rope scaling); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = arch_config(arch) | (overrides or {})
    ids = build_tokenizer(config["vocab_size"], seed, out)
    config |= {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[EOS]}
    model = build_model(config, seed=seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def mlx_lm_has(arch: str) -> bool:
    """Whether the installed mlx-lm implements ``arch``."""
    try:
        importlib.import_module(f"mlx_lm.models.{arch}")
    except ImportError:
        return False
    return True
