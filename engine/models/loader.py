"""Load a checkpoint through mlx-lm and describe what the paged runners need.

Two runners: the specialised one (batchd.engine.forward.model_runner) for the
Llama family with full attention, and the generic one
(batchd.engine.forward.generic_runner) for any other architecture mlx-lm
serves, running mlx-lm's own classes over the pool. ``ModelSpec.generic`` says
which. Refused, with the missing feature named: an architecture mlx-lm does not
have (before its weights are read), and layers that keep a state the KV pool
cannot hold (recurrent / SSM state, K/V shared between layers, layers of
different KV shapes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import mlx.nn as nn

from batchd.engine.exceptions import UnsupportedModelError
from batchd.engine.models.probe import ProbeError, probe_model

log = logging.getLogger(__name__)

# Architectures of the specialised runner (with full attention only); the rest of what
# mlx-lm serves runs on the generic path.
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = FAST_MODEL_TYPES
# mlx-lm caches that hold plain attention K/V, which the pool replaces.
_KV_CACHES = ("KVCache", "RotatingKVCache", "ChunkedKVCache")
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
    # Run by the generic runner (mlx-lm's own forward over the pool).
    generic: bool = False
    # Positions a token attends back over (itself included) when every layer attends
    # within a window; None when any layer sees the whole context. With a window, the
    # blocks a sequence's next tokens can no longer see go back to the pool.
    kv_window: int | None = None

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


def _mlx_lm_module(model_type: str) -> str:
    from mlx_lm.utils import MODEL_REMAPPING

    return f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}"


def check_config(config: dict[str, Any], *, source: str) -> None:
    """Raise UnsupportedModelError if no runner can run this architecture."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedModelError(f"{source}: config.json has no model_type")
    try:
        found = importlib.util.find_spec(_mlx_lm_module(model_type)) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        import mlx_lm

        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not an architecture mlx-lm "
            f"{mlx_lm.__version__} implements, so the paged engine cannot run it "
            "(a newer mlx-lm may)"
        )


def runs_fast(config: dict[str, Any]) -> bool:
    """Whether the specialised runner covers this config (else the generic one)."""
    layer_types = config.get("layer_types") or []
    return config.get("model_type") in FAST_MODEL_TYPES and all(
        t == "full_attention" for t in layer_types
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
        "loaded %s (%s, %d layers, %d/%d heads, %s; %s path)",
        source,
        spec.model_type,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.dtype,
        "generic" if spec.generic else "specialised",
    )
    return LoadedModel(model=model, tokenizer=tokenizer, config=full_config, spec=spec)


def _spec(model: nn.Module, config: dict[str, Any], *, source: str) -> ModelSpec:
    if runs_fast(config):
        rope_name = type(model.layers[0].self_attn.rope).__name__
        if rope_name in _PER_ROW_ROPES:
            return _fast_spec(model, config)
        log.info("%s: rope type %s takes the generic path", source, rope_name)
    return generic_spec(model, config, source=source)


def _fast_spec(model: nn.Module, config: dict[str, Any]) -> ModelSpec:
    layers = model.layers
    attn = layers[0].self_attn
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


def generic_spec(model: Any, config: dict[str, Any], *, source: str) -> ModelSpec:
    """The spec of a model for the generic runner, from its caches and one probe run;
    raises UnsupportedModelError naming what the pool cannot hold."""
    caches = model.make_cache() if hasattr(model, "make_cache") else []
    if caches:
        kinds = [type(c).__name__ for c in caches]
        other = sorted({k for k in kinds if k not in _KV_CACHES})
        if other:
            others = [i for i, k in enumerate(kinds) if k not in _KV_CACHES]
            raise UnsupportedModelError(
                f"{source}: layers {others} keep state of type {', '.join(other)} (recurrent or "
                "non-attention state); the paged engine holds attention K/V only"
            )
    try:
        layers, vocab = probe_model(model)
    except ProbeError as e:
        raise UnsupportedModelError(
            f"{source}: layers {e.layers} store no K/V of their own (K/V shared between "
            "layers); the paged engine needs one K/V per layer"
        ) from None
    shapes = sorted({(h, d) for h, d, _ in layers})
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"{source}: layers have different K/V shapes (kv_heads, head_dim) {shapes}; the "
            "paged engine's pool needs one shape for every layer"
        )
    kv_heads, head_dim = shapes[0]
    text = config.get("text_config") or {}
    return ModelSpec(
        model_type=str(config["model_type"]),
        num_layers=len(layers),
        num_heads=int(config.get("num_attention_heads") or text.get("num_attention_heads") or 0)
        or kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=config.get("max_position_embeddings")
        or text.get("max_position_embeddings"),
        dtype=layers[0][2],
        qk_norm=False,
        generic=True,
        kv_window=kv_window(caches),
    )


def kv_window(caches: list[Any]) -> int | None:
    """The widest window of mlx-lm's per-layer caches when every layer's is a sliding
    window with no kept (sink) tokens, else None. A model whose make_cache gives plain
    caches (or none) attends to the whole context."""
    windows = [
        c.max_size
        for c in caches
        if type(c).__name__ == "RotatingKVCache" and getattr(c, "keep", 0) == 0
    ]
    if not caches or len(windows) != len(caches):
        return None
    return int(max(windows))
