"""Random-weight LoRA adapters written as ``mlx_lm.lora`` writes them (or as PEFT does).

Tests and the benchmark need adapters, and nothing can be downloaded or trained
at length. A fixture adapter is an ordinary adapter directory for a given model,
with seeded random factors large enough that an adapted model's greedy tokens
differ from the base model's (a zero ``lora_b``, as training starts, would not
show a missing delta).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.adapters.layers import linear_dims
from batchd.engine.adapters.weights import CONFIG, MLX_WEIGHTS, PEFT_WEIGHTS

# Layer-relative keys, as mlx-lm's lora_parameters.keys name them.
ATTENTION_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_KEYS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def make_adapter(
    folder: Path,
    model: Any,
    *,
    seed: int,
    rank: int = 8,
    scale: float = 2.0,
    keys: Sequence[str] = ATTENTION_KEYS + MLP_KEYS,
    num_layers: int | None = None,
    peft: bool = False,
) -> Path:
    """Write an adapter of ``model`` (an mlx-lm model) to ``folder``: factors for ``keys``
    in its last ``num_layers`` layers (all by default). The delta of each layer has
    about ``scale`` times the spread of a unit-spread input's. PEFT's format keeps the
    same product (``lora_alpha = scale * rank``)."""
    layers = model.layers
    count = len(layers) if num_layers is None else num_layers
    rng = np.random.default_rng(seed)
    factors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for index in range(len(layers) - count, len(layers)):
        for key in keys:
            module: Any = layers[index]
            for part in key.split("."):
                module = getattr(module, part)
            in_dims, out_dims = linear_dims(module)
            a = rng.normal(0.0, in_dims**-0.5, (in_dims, rank)).astype(np.float32)
            b = rng.normal(0.0, rank**-0.5, (rank, out_dims)).astype(np.float32)
            factors[f"model.layers.{index}.{key}"] = (a, b)
    folder.mkdir(parents=True, exist_ok=True)
    if peft:
        config: dict[str, Any] = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": scale * rank,
            "target_modules": sorted({k.rsplit(".", 1)[-1] for k in keys}),
        }
        tensors = {
            f"base_model.model.{path}.lora_{half}.weight": mx.array(np.ascontiguousarray(w.T))
            for path, pair in factors.items()
            for half, w in zip("AB", pair, strict=True)
        }
        weights_file = PEFT_WEIGHTS
    else:
        config = {
            "fine_tune_type": "lora",
            "num_layers": count,
            "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)},
        }
        tensors = {
            f"{path}.lora_{half}": mx.array(w)
            for path, pair in factors.items()
            for half, w in zip("ab", pair, strict=True)
        }
        weights_file = MLX_WEIGHTS
    (folder / CONFIG).write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(folder / weights_file), tensors)
    return folder
