"""Load a checkpoint through mlx-lm and describe what the paged runner needs.

The runner reuses mlx-lm's modules (embedding, projections, norms, MLP, rope)
and replaces only attention and the cache, so only architectures whose
attention it reproduces exactly are accepted: the Llama family. Anything else
is refused here, before its weights are read, with the architecture named.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn

from batchd.engine.exceptions import UnsupportedModelError

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Rope classes whose offset may be an array of per-row positions.
_PER_ROW_ROPES = ("RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a loaded model that size the KV pool and drive attention."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None
    dtype: mx.Dtype
    qk_norm: bool

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size


@dataclass(frozen=True)
class LoadedModel:
    """An mlx-lm model, its tokenizer wrapper, raw config and derived spec."""

    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]
    spec: ModelSpec


def _resolve(path_or_repo: str | Path, revision: str | None) -> Path:
    """A local directory, or the hub snapshot holding at least config.json."""
    local = Path(path_or_repo).expanduser()
    if local.exists():
        return local
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(str(path_or_repo), revision=revision, allow_patterns=["config.json"])
    )


def check_config(config: dict[str, Any], *, source: str) -> None:
    """Raise UnsupportedModelError if the runner cannot run this architecture."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported by the paged engine; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"{source}: sliding-window attention layers ({sorted(set(layer_types))}) "
            "are not supported by the paged engine"
        )


def load(
    path_or_repo: str | Path, *, revision: str | None = None, dtype: str | None = None
) -> LoadedModel:
    """Load a local model directory or hub id (quantized checkpoints included).

    ``dtype`` (float32, float16, bfloat16) casts the floating-point weights.
    """
    from mlx_lm.utils import load as mlx_load

    source = str(path_or_repo)
    config = json.loads((_resolve(path_or_repo, revision) / "config.json").read_text())
    check_config(config, source=source)
    loaded: Any = mlx_load(source, revision=revision, return_config=True)
    model, tokenizer, full_config = loaded
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    spec = _spec(model, full_config, source=source)
    log.info(
        "loaded %s (%s, %d layers, %d/%d heads, %s)",
        source,
        spec.model_type,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.dtype,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, config=full_config, spec=spec)


def _spec(model: nn.Module, config: dict[str, Any], *, source: str) -> ModelSpec:
    layers = model.layers
    attn = layers[0].self_attn
    rope_name = type(attn.rope).__name__
    if rope_name not in _PER_ROW_ROPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_name} needs a scalar offset; the paged engine "
            f"supports {', '.join(_PER_ROW_ROPES)}"
        )
    n_heads = attn.n_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    dtype = model.model.embed_tokens(mx.array([0])).dtype
    return ModelSpec(
        model_type=config["model_type"],
        num_layers=len(layers),
        num_heads=n_heads,
        num_kv_heads=attn.n_kv_heads,
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings"),
        dtype=dtype,
        qk_norm=hasattr(attn, "q_norm"),
    )
